"""Kimi Delta Attention (KDA) over a flat varlen batch, states read and written in place in the state slab.

Recurrence per value head (state layout [K, V], FLA's), a per-key gate g_t in R^K:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

Paths: CPU -> `kda_rule_ref` (torch, float32, chunked WY form with per-key decays). The decays only
ever appear as exp(G_t - G_s) for s <= t inside a chunk (never exp(-G)), so no factor can overflow.
CUDA -> our Triton kernel for decode tokens (state updated by slot in place, CUDA-graph capturable)
and FLA's varlen `chunk_kda` for prefill sequences in bf16/fp16 (float32 takes the chunked reference:
FLA would compute it in tf32).
"""
from __future__ import annotations

from typing import Any

import torch

from hypic.kernels.gdn import CHUNK, _unit_lower_inverse  # the gated delta rule's WY chunking, shared
from hypic.kernels.triton_lazy import triton_kernel
from hypic.kernels.varlen import (decode_launch, decode_program, decode_state, expand_key_heads, fla_cu_seqlens,
                                  initial_states, recurrence_reference, to_chunks)

tl: Any  # triton.language, bound by triton_lazy on first GPU use



def kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
             scale: float, num_decodes: int, seq_lens_cpu: tuple[int, ...]) -> torch.Tensor:
    """q, k: [N, H, K] (l2-normalised); v: [N, HV, V]; g: [N, HV, K] log-decay (float32); beta: [N, HV].
    Value head hv uses key head hv // (HV // H). Sequence b starts from ssm_pool[slots[b]] if
    has_state[b] else zeros; its final state goes back there. Returns [N, HV, V] in v's dtype."""
    nd = num_decodes
    if q.device.type != "cuda":
        return kda_rule_ref(q, k, v, g, beta, ssm_pool, slots, has_state, cu_seqlens, scale=scale,
                            num_decodes=nd, seq_lens_cpu=seq_lens_cpu)
    o = torch.empty_like(v)
    if nd:
        kda_decode_triton(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], ssm_pool, slots[:nd], has_state[:nd],
                          scale=scale, out=o[:nd])
    if len(seq_lens_cpu) > nd:
        rows, lens = slice(nd, None), seq_lens_cpu[nd:]
        if v.dtype == torch.float32:  # FLA would compute it in tf32
            o[rows] = kda_rule_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_pool, slots[rows],
                                   has_state[rows], cu_seqlens[rows], scale=scale, num_decodes=0, seq_lens_cpu=lens)
        else:
            o[rows] = _prefill_fla(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_pool, slots[rows],
                                   has_state[rows], scale=scale, seq_lens=lens)
    return o


def _prefill_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, *, scale: float,
                 seq_lens: tuple[int, ...]) -> torch.Tensor:
    """FLA's varlen KDA chunk kernel (B = 1, key heads expanded to the value heads, the gate already in
    log space and per key; spans from seq_lens, as `fla_cu_seqlens` says); states are gathered from
    and scattered to the slab."""
    from fla.ops.kda import chunk_kda

    hv = v.shape[1]
    cu, cu_cpu = fla_cu_seqlens(seq_lens, q.device)
    o, final = chunk_kda(expand_key_heads(q, hv)[None], expand_key_heads(k, hv)[None], v[None], g[None].float(),
                         beta[None], scale=scale, initial_state=initial_states(ssm_pool, slots, has_state),
                         output_final_state=True, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                         cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    ssm_pool.index_copy_(0, slots, final.float())
    return o[0]



# ----------------------------------------------------------------------------- torch reference

def kda_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
                 scale: float, num_decodes: int, seq_lens_cpu: tuple[int, ...]) -> torch.Tensor:
    """Same contract as `kda_rule` (cu_seqlens unused: spans follow seq_lens_cpu), pure torch, float32 math."""
    return recurrence_reference(q, k, v, (g, beta), ssm_pool, slots, has_state, scale=scale, num_decodes=num_decodes,
                                seq_lens_cpu=seq_lens_cpu, step=_recurrent_step, sequence=chunked_sequence)


def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of many sequences: q, k, g [B, HV, K]; v [B, HV, V]; state [B, HV, K, V]."""
    state = state * g.exp()[..., None]
    err = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    state = state + k[..., :, None] * err[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q * scale), state


def chunked_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks (WY form). q, k, g: [T, HV, K]; v: [T, HV, V]; beta: [T, HV]; state
    [HV, K, V]. With G the running gate sum inside a chunk and e_t = beta_t (v_t - k_t^T D_t S_{t-1})
    the per-token corrections, (I + A) E = beta (V - (k exp(G)) S_in) with A[t, s] = beta_t sum_k
    k_t k_s exp(G_t - G_s) (s < t), so E = U - W S_in; outputs and end state follow by matmuls."""
    length = q.shape[0]
    if not length:  # an empty span leaves the state as it is
        return v.clone(), state
    q, k, v, g, beta = (to_chunks(t, length, CHUNK) for t in (q * scale, k, v, g, beta))  # [HV, n, C, ...]
    cum = g.cumsum(-2)
    decay = _pairwise_decay(cum)  # [HV, n, C, C, K]
    coupling = (torch.einsum("hntk,hnsk,hntsk->hnts", k, k, decay) * beta[..., None]).tril(-1)
    inverse = _unit_lower_inverse(coupling)
    w = inverse @ (beta[..., None] * k * cum.exp())
    u = inverse @ (beta[..., None] * v)
    attn = torch.einsum("hntk,hnsk,hntsk->hnts", q, k, decay)
    q_decayed = q * cum.exp()
    k_to_end = k * (cum[..., -1:, :] - cum).exp()
    outs = []
    for i in range(q.shape[1]):  # only the state hand-off between chunks is sequential
        err = u[:, i] - w[:, i] @ state
        outs.append(q_decayed[:, i] @ state + attn[:, i] @ err)
        state = cum[:, i, -1].exp()[..., None] * state + k_to_end[:, i].transpose(-1, -2) @ err
    o = torch.stack(outs, 1).flatten(1, 2)[:, :length]
    return o.transpose(0, 1), state


def _pairwise_decay(cum: torch.Tensor) -> torch.Tensor:
    """exp(G_t - G_s) per key channel for s <= t, 0 above the diagonal: [..., C, K] -> [..., C, C, K]."""
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=cum.device).tril()
    diff = cum[..., :, None, :] - cum[..., None, :, :]
    return diff.masked_fill(~causal[..., None], float("-inf")).exp()


# ----------------------------------------------------------------------------- GPU: Triton decode

def kda_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, *, scale: float,
                      out: torch.Tensor) -> None:
    """One token per sequence: reads ssm_pool[slots[b]], writes the new state back in place and the
    output into `out` [B, HV, V]. No host sync, fixed grid: CUDA-graph capturable."""
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    grid, shape = decode_launch(q, v)
    _kda_decode_kernel[grid](q, k, v, g, beta.contiguous(), out, ssm_pool, slots, has_state, scale, out.stride(0),
                             **shape)


@triton_kernel
def _kda_decode_kernel(q, k, v, g, beta, o, pool, slots, has_state, scale, stride_o, H: tl.constexpr,
                       HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_b, i_hv, i_h, o_k, o_v, m_k, m_v, slot = decode_program(slots, H, HV, K, V, BK, BV)
    p_state, m_state, state = decode_state(pool, slot, i_hv, o_k, o_v, m_k, m_v, tl.load(has_state + i_b) != 0,
                                           HV, K, V)
    b_q = tl.load(q + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + (i_b * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g + (i_b * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # one gate per key row
    b_beta = tl.load(beta + i_b * HV + i_hv).to(tl.float32)
    state = state * tl.exp(b_g)[:, None]
    err = b_beta * (b_v - tl.sum(state * b_k[:, None], axis=0))
    state = state + b_k[:, None] * err[None, :]
    b_o = tl.sum(state * b_q[:, None], axis=0)
    tl.store(o + i_b * stride_o + i_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_state, state, mask=m_state)
