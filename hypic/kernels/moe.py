"""Mixture-of-experts MLP: y = sum_k w_k * down_e(silu(gate_e x) * up_e x), e = topk_ids[:, k].

Paths: CPU -> `fused_moe_ref` (a loop over the experts that have tokens); CUDA -> token-expert
pairs sorted by expert, then grouped GEMMs without a Python loop over experts and without host
syncs (CUDA-graph capturable): `torch._grouped_mm` (CUTLASS) for bf16 on sm90/sm100, where it
needs no device-to-host copy, otherwise our Triton grouped GEMM over expert-padded row blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.triton_lazy import triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [N, H]; w_gate_up: [E, 2I, H] (gate rows, then up rows); w_down: [E, H, I];
    topk_weights: [N, k] float; topk_ids: [N, k] int64. Returns [N, H] in x's dtype."""
    if x.device.type != "cuda":
        return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids)
    if _cutlass_grouped_mm_applies(x, w_down):
        return moe_grouped_mm(x, w_gate_up, w_down, topk_weights, topk_ids)
    return moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids)


# ----------------------------------------------------------------------------- torch reference

def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as `fused_moe`, float32 math, one matmul pair per expert that has tokens."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w_down.shape[2]
    for expert in topk_ids.unique().tolist():
        token, which = (topk_ids == expert).nonzero(as_tuple=True)
        h = x[token].float() @ w_gate_up[expert].float().T
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w_down[expert].float().T
        out.index_add_(0, token, y * topk_weights[token, which, None].float())
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- GPU: shared

def _sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): pair indices (token * k + slot) grouped by expert, and pairs per expert."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    return order, counts


def _weighted_sum(pair_out: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N*k, H] expert outputs in pair order -> [N, H]: each token's k outputs, weighted."""
    per_token = pair_out.view(*topk_weights.shape, -1).float()
    return (per_token * topk_weights[..., None].float()).sum(1).to(dtype)


# ----------------------------------------------------------------------------- GPU: CUTLASS

def _cutlass_grouped_mm_applies(x: torch.Tensor, w_down: torch.Tensor) -> bool:
    """bf16 on sm90/sm100 runs CUTLASS; other cases fall back to a loop that syncs on offsets.
    Its TMA loads want 16-byte aligned rows."""
    aligned = x.shape[1] % 8 == 0 and w_down.shape[2] % 8 == 0
    major = torch.cuda.get_device_capability(x.device)[0]
    return x.dtype == torch.bfloat16 and major in (9, 10) and aligned and hasattr(torch, "_grouped_mm")


def moe_grouped_mm(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    order, counts = _sort_by_expert(topk_ids, w_gate_up.shape[0])
    offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
    rows = x[order // topk_ids.shape[1]]
    h = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets)
    inter = w_down.shape[2]
    y_sorted = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w_down.transpose(1, 2), offs=offsets)
    pair_out = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return _weighted_sum(pair_out, topk_weights, x.dtype)


# ----------------------------------------------------------------------------- GPU: Triton

@dataclass(frozen=True)
class ExpertBlocks:
    """Pairs sorted by expert, each expert's run padded to a multiple of `block` rows.

    Invariant: rows[i] is a pair index, or num_pairs for padding; block j serves
    expert block_expert[j] (num_experts past the last used block). The block count is an upper
    bound fixed by shapes alone: sum_e ceil(c_e / block) <= pairs // block + min(E, pairs)."""

    rows: torch.Tensor  # [num_blocks * block] int64
    block_expert: torch.Tensor  # [num_blocks] int64
    block: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def expert_blocks(topk_ids: torch.Tensor, num_experts: int, block: int) -> ExpertBlocks:
    order, counts = _sort_by_expert(topk_ids, num_experts)
    pairs = order.shape[0]
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    expert = topk_ids.flatten()[order]
    rank = torch.arange(pairs, device=order.device) - (counts.cumsum(0) - counts)[expert]
    num_blocks = pairs // block + min(num_experts, pairs)
    rows = torch.full((num_blocks * block,), pairs, dtype=torch.long, device=order.device)
    rows.index_copy_(0, padded_start[expert] + rank, order)
    starts = torch.arange(num_blocks, device=order.device) * block
    return ExpertBlocks(rows, torch.searchsorted(padded_end, starts, right=True), block)


def moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
    num_experts, inter, hidden = w_down.shape[0], w_down.shape[2], x.shape[1]
    pairs = topk_ids.numel()
    # 64-row blocks once experts average 32+ rows; float32 always 16 (its 64-row tiles spill)
    many_rows = pairs >= 32 * num_experts and x.dtype != torch.float32
    blocks = expert_blocks(topk_ids, num_experts, 64 if many_rows else 16)
    launch = dict(BM=blocks.block, BN=64, BK=64, num_warps=8 if many_rows else 4,
                  DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(blocks.num_blocks, -(-inter // 64))](
        x, w_gate_up, blocks.rows, blocks.block_expert, act, pairs, x.stride(0), w_gate_up.stride(0),
        w_gate_up.stride(1), act.stride(0), TOPK=topk_ids.shape[1], NUM_EXPERTS=num_experts, I=inter,
        H=hidden, **launch)
    pair_out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _moe_down_kernel[(blocks.num_blocks, -(-hidden // 64))](
        act, w_down, blocks.rows, blocks.block_expert, pair_out, pairs, act.stride(0), w_down.stride(0),
        w_down.stride(1), pair_out.stride(0), NUM_EXPERTS=num_experts, I=inter, H=hidden, **launch)
    return _weighted_sum(pair_out, topk_weights, x.dtype)


@triton_kernel
def _moe_gate_up_kernel(x, w, rows, block_expert, act, num_pairs, stride_x, stride_we, stride_wn, stride_a,
                        TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr, I: tl.constexpr, H: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """act[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, I + n]) for one block of pairs."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert + i_m)
    if expert >= NUM_EXPERTS:
        return
    pair = tl.load(rows + i_m * BM + tl.arange(0, BM))
    m_row = pair < num_pairs
    token = pair // TOPK
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    p_w = w + expert * stride_we + o_n[None, :] * stride_wn
    acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < H
        b_x = tl.load(x + token[:, None] * stride_x + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
        b_gate = tl.load(p_w + o_k[:, None], mask=m_w, other=0.0)
        b_up = tl.load(p_w + I * stride_wn + o_k[:, None], mask=m_w, other=0.0)
        acc_gate = tl.dot(b_x, b_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(b_x, b_up, acc_up, input_precision=DOT_PRECISION)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act + pair[:, None] * stride_a + o_n[None, :], h.to(act.dtype.element_ty),
             mask=m_row[:, None] & m_n[None, :])


@triton_kernel
def _moe_down_kernel(act, w, rows, block_expert, out, num_pairs, stride_a, stride_we, stride_wn, stride_o,
                     NUM_EXPERTS: tl.constexpr, I: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[pair, n] = act[pair] . w[e, n] (float32) for one block of pairs."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert + i_m)
    if expert >= NUM_EXPERTS:
        return
    pair = tl.load(rows + i_m * BM + tl.arange(0, BM))
    m_row = pair < num_pairs
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    p_w = w + expert * stride_we + o_n[None, :] * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < I
        b_a = tl.load(act + pair[:, None] * stride_a + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc = tl.dot(b_a, b_w, acc, input_precision=DOT_PRECISION)
    tl.store(out + pair[:, None] * stride_o + o_n[None, :], acc, mask=m_row[:, None] & m_n[None, :])
