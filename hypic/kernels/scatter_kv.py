"""Rotate-and-scatter of cached interior K/V into a request's paged KV (DESIGN §2, §3.5).

The public pool keeps a segment's interior K *before* RoPE (after k_norm) and V. On a hit, every
interior token is written into the request's pages at its global position, K rotated once there
(NeoX-style partial RoPE: the first rotary_dim = 2 * len(inv_freq) dims of each head, as two
halves; the rest passes through). V is position-free and copied as is.

Source layout (the segment store's, DESIGN §4): `kv_src` is one flat tensor in the KV dtype; token
m's K block [Hkv, D] starts at element src_off[m] and its V block follows right after it
(src_off[m] + Hkv * D). Destination: k_cache / v_cache [num_blocks, block_size, Hkv, D], token m
written at flat slot dst_slots[m] = block * block_size + offset, as in `write_kv`.
"""
from __future__ import annotations

from typing import Any

import torch

from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (float32) of default RoPE, computed exactly as the
    model's RotaryEmbedding does, so cached and recomputed keys see bitwise-equal angles."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return 1.0 / (theta ** exponents)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX partial RoPE of x [..., D] at `positions` (broadcastable to x.shape[:-1]).

    Angles are position * inv_freq in float32 (float64 for float64 x); the rotation runs in that
    precision and rounds once to x's dtype."""
    math_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = inv_freq.numel()
    angles = positions.to(math_dtype)[..., None] * inv_freq.to(x.device, math_dtype)
    cos, sin = angles.cos(), angles.sin()
    wide = x.to(math_dtype)
    x1, x2, rest = wide[..., :half], wide[..., half: 2 * half], wide[..., 2 * half:]
    first, second = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rest = rest.expand(*first.shape[:-1], rest.shape[-1])
    return torch.cat((first, second, rest), dim=-1).to(x.dtype)


def scatter_kv(kv_src: torch.Tensor, src_off: torch.Tensor, positions: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, dst_slots: torch.Tensor,
               inv_freq: torch.Tensor, v_offset: int | None = None) -> None:
    """Write M cached tokens (K rotated to `positions`, V as is) into the paged caches in place.
    kv_src: 1-D; src_off, positions, dst_slots: [M] int64; inv_freq: [rotary_dim // 2] float32.
    A token's V starts v_offset elements after its K (default: right after it; 0: V is K's rows, for
    unrotated MLA latents whose k_cache and v_cache are one tensor)."""
    if kv_src.device.type == "cuda":
        scatter_kv_triton(kv_src, src_off, positions, k_cache, v_cache, dst_slots, inv_freq, v_offset)
    else:
        scatter_kv_ref(kv_src, src_off, positions, k_cache, v_cache, dst_slots, inv_freq, v_offset)


def scatter_kv_ref(kv_src: torch.Tensor, src_off: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, dst_slots: torch.Tensor,
                   inv_freq: torch.Tensor, v_offset: int | None = None) -> None:
    """Torch reference of `scatter_kv`."""
    heads, head_dim = k_cache.shape[-2:]
    v_offset = _v_start(k_cache, v_offset)
    row = torch.arange(heads * head_dim, device=kv_src.device)
    k_rows, v_rows = (kv_src[src_off[:, None] + start + row].view(-1, heads, head_dim) for start in (0, v_offset))
    v_cache.view(-1, heads, head_dim)[dst_slots] = v_rows.to(v_cache.dtype)
    k = apply_rope(k_rows, positions[:, None], inv_freq)
    k_cache.view(-1, heads, head_dim)[dst_slots] = k.to(k_cache.dtype)


def _v_start(k_cache: torch.Tensor, v_offset: int | None) -> int:
    """Where a token's V starts after its K: given, or right after the K of all heads."""
    return k_cache.shape[-2] * k_cache.shape[-1] if v_offset is None else v_offset


# ----------------------------------------------------------------------------- Triton

def scatter_kv_triton(kv_src: torch.Tensor, src_off: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, dst_slots: torch.Tensor,
                      inv_freq: torch.Tensor, v_offset: int | None = None) -> None:
    """Launch the Triton kernel (one program per token x kv head); same contract as `scatter_kv`."""
    heads, head_dim = k_cache.shape[-2:]
    v_offset = _v_start(k_cache, v_offset)
    if src_off.numel() == 0:
        return
    half = inv_freq.numel()
    _scatter_kv_kernel[(src_off.numel(), heads)](
        kv_src, src_off, positions, k_cache, v_cache, dst_slots, inv_freq.float().contiguous(), v_offset,
        HKV=heads, D=head_dim, HALF=half, BH=max(2, next_power_of_2(half)), BD=next_power_of_2(head_dim))


@triton_kernel
def _scatter_kv_kernel(kv_src, src_off, positions, k_cache, v_cache, dst_slots, inv_freq, v_offset,
                       HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       BH: tl.constexpr, BD: tl.constexpr):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    src = kv_src + tl.load(src_off + i_m) + i_h * D
    dst = (tl.load(dst_slots + i_m) * HKV + i_h) * D
    oh = tl.arange(0, BH)
    mh = oh < HALF
    angle = tl.load(positions + i_m).to(tl.float32) * tl.load(inv_freq + oh, mask=mh, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    x1 = tl.load(src + oh, mask=mh, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + oh, mask=mh, other=0.0).to(tl.float32)
    k_ty = k_cache.dtype.element_ty
    tl.store(k_cache + dst + oh, (x1 * cos - x2 * sin).to(k_ty), mask=mh)
    tl.store(k_cache + dst + HALF + oh, (x2 * cos + x1 * sin).to(k_ty), mask=mh)
    od = tl.arange(0, BD)
    rest = (od >= 2 * HALF) & (od < D)
    tl.store(k_cache + dst + od, tl.load(src + od, mask=rest).to(k_ty), mask=rest)
    v_row = tl.load(src + v_offset + od, mask=od < D)
    tl.store(v_cache + dst + od, v_row.to(v_cache.dtype.element_ty), mask=od < D)
