"""Gated delta rule over a flat varlen batch, states read and written in place in the state slab.

Recurrence per value head (state layout [K, V], FLA's):
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

Paths: CPU -> `gated_delta_rule_ref` (torch, float32, chunked WY form); CUDA -> FLA's chunk kernel
for prefill sequences (bf16/fp16; float32 takes the torch reference, FLA would compute it in tf32)
and our Triton kernel for decode tokens, which updates ssm_pool by slot in
place (no gather/scatter: the decode step must be cheap and CUDA-graph capturable).
"""
from __future__ import annotations

from typing import Any

import torch

from hypic.kernels.host_copy import host_to_device
from hypic.kernels.triton_lazy import triton_kernel
from hypic.kernels.varlen import (decode_launch, decode_program, decode_state, fla_cu_seqlens, initial_states,
                                  recurrence_reference, step_cache, to_chunks)

tl: Any  # triton.language, bound by triton_lazy on first GPU use

CHUNK = 64  # tokens per chunk of the reference's WY form
FLA_CHUNK = 64  # tokens per chunk of FLA's kernel (its default), which its chunk indices must match


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                     num_decodes: int, seq_lens_cpu: tuple[int, ...]) -> torch.Tensor:
    """q, k: [N, H, K] (l2-normalised); v: [N, HV, V]; g: [N, HV] log-decay; beta: [N, HV].
    Value head hv uses key head hv // (HV // H). Sequence b starts from ssm_pool[slots[b]] if
    has_state[b] else zeros; its final state goes back to ssm_pool[slots[b]]. Returns [N, HV, V]."""
    if q.device.type != "cuda":
        return gated_delta_rule_ref(q, k, v, g, beta, ssm_pool, slots, has_state, cu_seqlens, scale=scale,
                                    num_decodes=num_decodes, seq_lens_cpu=seq_lens_cpu)
    o = torch.empty_like(v)
    nd = num_decodes
    if nd:
        gdn_decode_triton(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], ssm_pool, slots[:nd], has_state[:nd],
                          scale=scale, out=o[:nd])
    if len(seq_lens_cpu) > nd:
        rows, lens = slice(nd, None), seq_lens_cpu[nd:]
        if v.dtype == torch.float32:  # float32 means float32: FLA's float32 dots run as tf32 (~1e-3 off)
            o[rows] = gated_delta_rule_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_pool, slots[rows],
                                           has_state[rows], cu_seqlens[rows], scale=scale, num_decodes=0,
                                           seq_lens_cpu=lens)
        else:
            o[rows] = _prefill_fla(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_pool, slots[rows],
                                   has_state[rows], scale=scale, seq_lens=lens)
    return o


# ----------------------------------------------------------------------------- torch reference

def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor,
                         has_state: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                         num_decodes: int, seq_lens_cpu: tuple[int, ...]) -> torch.Tensor:
    """Same contract as `gated_delta_rule`, in pure torch with float32 math."""
    return recurrence_reference(q, k, v, (g, beta), ssm_pool, slots, has_state, scale=scale, num_decodes=num_decodes,
                                seq_lens_cpu=seq_lens_cpu, step=_recurrent_step, sequence=_chunked_sequence)




def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of many sequences at once: q, k [B, HV, K]; v [B, HV, V]; state [B, HV, K, V]."""
    state = state * g.exp()[..., None, None]
    err = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    state = state + k[..., :, None] * err[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q * scale), state


def _chunked_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks (WY form). q, k: [T, HV, K]; v: [T, HV, V]; g, beta: [T, HV];
    state: [HV, K, V]. Within a chunk with cumulative log-decay G, the per-token corrections
    e_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t) solve a unit lower-triangular system, so
    E = U - W S0 with U, W independent of S0; outputs and end state follow by matmuls."""
    length = q.shape[0]
    q, k, v, g, beta = (to_chunks(t, length, CHUNK) for t in (q * scale, k, v, g, beta))  # [HV, n, C, ...]
    cum, decay, w, u, k_to_end = chunk_wy(k, v, g, beta)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    outs = []
    for i in range(q.shape[1]):  # only the state hand-off between chunks is sequential
        err = u[:, i] - w[:, i] @ state
        outs.append(q_decayed[:, i] @ state + attn[:, i] @ err)
        state = cum[:, i, -1].exp()[:, None, None] * state + k_to_end[:, i].transpose(-1, -2) @ err
    o = torch.stack(outs, 1).flatten(1, 2)[:, :length]
    return o.transpose(0, 1), state


def chunk_wy(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The WY factors of chunks (k [..., C, K], v [..., C, V], g, beta [..., C]): the cumulative log-decay
    G, exp(G_t - G_s) (s <= t), W and U, and the keys decayed to the chunk's end. A chunk maps its
    entry state S to exp(G_C) S + k_to_end^T (U - W S)."""
    cum = g.cumsum(-1)
    decay = _pairwise_decay(cum)
    coupling = ((k @ k.transpose(-1, -2)) * decay * beta[..., None]).tril(-1)
    inverse = _unit_lower_inverse(coupling)
    w = inverse @ ((beta * cum.exp())[..., None] * k)
    u = inverse @ (beta[..., None] * v)
    return cum, decay, w, u, k * (cum[..., -1:] - cum).exp()[..., None]


def _pairwise_decay(cum: torch.Tensor) -> torch.Tensor:
    """exp(G_t - G_j) for j <= t, 0 above the diagonal: [..., C] -> [..., C, C]."""
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=cum.device).tril()
    return (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()


def _unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for a strictly lower-triangular L (solving against I, then matmuls, is far
    faster on CPU than triangular solves with wide right-hand sides)."""
    eye = torch.eye(CHUNK, dtype=strict_lower.dtype, device=strict_lower.device).expand_as(strict_lower)
    return torch.linalg.solve_triangular(strict_lower, eye, upper=False, unitriangular=True)


# ----------------------------------------------------------------------------- GPU: FLA prefill

def _prefill_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, *, scale: float,
                 seq_lens: tuple[int, ...]) -> torch.Tensor:
    """FLA's varlen chunk kernel (B = 1; spans from seq_lens, as `fla_cu_seqlens` says: the same offsets
    for every layer of a step, no host copy per layer); states are gathered from and scattered to the slab."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu, cu_cpu = fla_cu_seqlens(seq_lens, q.device)
    o, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None].float(), beta[None], scale=scale,
        initial_state=initial_states(ssm_pool, slots, has_state), output_final_state=True,
        use_qk_l2norm_in_kernel=False, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
        chunk_indices=_fla_chunk_indices(seq_lens, q.device), chunk_size=FLA_CHUNK)
    ssm_pool.index_copy_(0, slots, final)
    return o[0]


@step_cache  # every linear layer of a step asks for the same lengths; FLA only reads it
def _fla_chunk_indices(seq_lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """FLA's `prepare_chunk_indices`, built on the host: [chunks, 2] (sequence, chunk within it).
    FLA's own copies its host result with a pageable `.to()`, which syncs the stream."""
    pairs = [(b, i) for b, n in enumerate(seq_lens) for i in range(-(-n // FLA_CHUNK))]
    return host_to_device(pairs, torch.long, device).view(-1, 2)


# ----------------------------------------------------------------------------- GPU: Triton decode

def gdn_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, *, scale: float,
                      out: torch.Tensor) -> None:
    """One token per sequence: reads ssm_pool[slots[b]], writes the new state back in place and
    the output into `out` [B, HV, V]. No host sync, fixed grid: CUDA-graph capturable."""
    q, k, v = map(_rows_contiguous, (q, k, v))
    grid, shape = decode_launch(q, v)
    _gdn_decode_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(), out, ssm_pool, slots, has_state, scale,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0), **shape)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take a token stride but need each token's [heads, dim] block dense."""
    dense = x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    return x if dense else x.contiguous()


@triton_kernel
def _gdn_decode_kernel(q, k, v, g, beta, o, pool, slots, has_state, scale,
                       stride_q, stride_k, stride_v, stride_o,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr):
    i_b, i_hv, i_h, o_k, o_v, m_k, m_v, slot = decode_program(slots, H, HV, K, V, BK, BV)
    p_state, m_state, state = decode_state(pool, slot, i_hv, o_k, o_v, m_k, m_v, tl.load(has_state + i_b) != 0,
                                           HV, K, V)
    b_q = tl.load(q + i_b * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + i_b * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_b * stride_v + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g + i_b * HV + i_hv).to(tl.float32)
    b_beta = tl.load(beta + i_b * HV + i_hv).to(tl.float32)
    state = state * tl.exp(b_g)
    err = b_beta * (b_v - tl.sum(state * b_k[:, None], axis=0))
    state = state + b_k[:, None] * err[None, :]
    b_o = tl.sum(state * b_q[:, None], axis=0)
    tl.store(o + i_b * stride_o + i_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_state, state, mask=m_state)
