"""Scalar-gated linear recurrence (Mamba2's SSD, FLA's simple GLA) over a flat varlen batch, states
read and written in place in the state slab.

Recurrence per value head (state layout [K, V], as the gated delta rule's):
    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)
Mamba2 maps onto it with q = C, k = B (per group, shared by the group's heads as key heads under
GVA), v = dt x, g = dt A, scale 1; its D skip and gate stay in the layer.

Paths: CPU -> `scalar_gated_rule_ref` (torch, float32, chunked: the oracle); CUDA -> FLA's
`chunk_simple_gla` for prefill sequences (bf16/fp16; float32 takes the reference, FLA would compute
it in tf32) with the key heads expanded to the value heads, and our Triton kernel for decode tokens,
which updates ssm_pool by slot in place (CUDA-graph capturable).
"""
from __future__ import annotations

from typing import Any

import torch

from hypic.kernels.triton_lazy import triton_kernel
from hypic.kernels.varlen import (decode_launch, decode_program, decode_state, expand_key_heads, fla_cu_seqlens,
                                  initial_states, recurrence_reference, to_chunks)

tl: Any  # triton.language, bound by triton_lazy on first GPU use

CHUNK = 64  # tokens per chunk of the reference


def scalar_gated_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                      cu_seqlens: torch.Tensor, *, scale: float, num_decodes: int,
                      seq_lens_cpu: tuple[int, ...]) -> torch.Tensor:
    """q, k: [N, H, K]; v: [N, HV, V]; g: [N, HV] log-decay (float32). Value head hv uses key head
    hv // (HV // H). Sequence b starts from ssm_pool[slots[b]] if has_state[b] else zeros; its final
    state goes back there. Returns [N, HV, V] in v's dtype."""
    if q.device.type != "cuda":
        return scalar_gated_rule_ref(q, k, v, g, ssm_pool, slots, has_state, cu_seqlens, scale=scale,
                                     num_decodes=num_decodes, seq_lens_cpu=seq_lens_cpu)
    o = torch.empty_like(v)
    nd = num_decodes
    if nd:
        scalar_decode_triton(q[:nd], k[:nd], v[:nd], g[:nd], ssm_pool, slots[:nd], has_state[:nd],
                             scale=scale, out=o[:nd])
    if len(seq_lens_cpu) > nd:
        rows, lens = slice(nd, None), seq_lens_cpu[nd:]
        if v.dtype == torch.float32:  # FLA would compute it in tf32
            o[rows] = scalar_gated_rule_ref(q[rows], k[rows], v[rows], g[rows], ssm_pool, slots[rows],
                                            has_state[rows], cu_seqlens[rows], scale=scale, num_decodes=0,
                                            seq_lens_cpu=lens)
        else:
            o[rows] = _prefill_fla(q[rows], k[rows], v[rows], g[rows], ssm_pool, slots[rows], has_state[rows],
                                   scale=scale, seq_lens=lens)
    return o


# ----------------------------------------------------------------------------- torch reference

def scalar_gated_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                          cu_seqlens: torch.Tensor, *, scale: float, num_decodes: int,
                          seq_lens_cpu: tuple[int, ...]) -> torch.Tensor:
    """Same contract as `scalar_gated_rule`, in pure torch with float32 math."""
    return recurrence_reference(q, k, v, (g,), ssm_pool, slots, has_state, scale=scale, num_decodes=num_decodes,
                                seq_lens_cpu=seq_lens_cpu, step=_recurrent_step, sequence=chunked_sequence)


def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of many sequences: q, k [B, HV, K]; v [B, HV, V]; g [B, HV]; state [B, HV, K, V]."""
    state = state * g.exp()[..., None, None] + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q * scale), state




def chunked_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks: q, k [T, HV, K]; v [T, HV, V]; g [T, HV]; state [HV, K, V] (float32).
    Inside a chunk with cumulative log-decay G, o_t = sum_{s<=t} exp(G_t - G_s) (q_t.k_s) v_s plus
    exp(G_t) S_in^T q_t; the state leaves as exp(G_end) S_in + sum_s exp(G_end - G_s) k_s v_s^T."""
    length = q.shape[0]
    if not length:  # an empty span leaves its state as it is
        return v.new_zeros(v.shape), state
    q, k, v, g = (to_chunks(t, length, CHUNK) for t in (q * scale, k, v, g))  # [HV, n, C, ...]
    cum = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=g.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    intra = ((q @ k.transpose(-1, -2)) * decay) @ v
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    outs = []
    for i in range(q.shape[1]):  # only the state hand-off between chunks is sequential
        outs.append(intra[:, i] + q_decayed[:, i] @ state)
        state = cum[:, i, -1].exp()[:, None, None] * state + k_to_end[:, i].transpose(-1, -2) @ v[:, i]
    o = torch.stack(outs, 1).flatten(1, 2)[:, :length]
    return o.transpose(0, 1), state



# ----------------------------------------------------------------------------- GPU: FLA prefill

def _prefill_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, ssm_pool: torch.Tensor,
                 slots: torch.Tensor, has_state: torch.Tensor, *, scale: float,
                 seq_lens: tuple[int, ...]) -> torch.Tensor:
    """FLA's varlen simple-GLA chunk kernel (B = 1) with q, k expanded to the value heads; states
    are gathered from and scattered to the slab."""
    from fla.ops.simple_gla import chunk_simple_gla

    hv = v.shape[1]
    cu, cu_cpu = fla_cu_seqlens(seq_lens, q.device)
    o, final = chunk_simple_gla(
        expand_key_heads(q, hv)[None], expand_key_heads(k, hv)[None], v[None], g=g[None].float(), scale=scale,
        initial_state=initial_states(ssm_pool, slots, has_state), output_final_state=True, cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu)
    ssm_pool.index_copy_(0, slots, final.float())
    return o[0]


# ----------------------------------------------------------------------------- GPU: Triton decode

def scalar_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, *, scale: float,
                         out: torch.Tensor) -> None:
    """One token per sequence: reads ssm_pool[slots[b]], writes the new state back in place and the
    output into `out` [B, HV, V]. No host sync, fixed grid: CUDA-graph capturable."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    grid, shape = decode_launch(q, v)
    _scalar_decode_kernel[grid](q, k, v, g.contiguous(), out, ssm_pool, slots, has_state, scale, out.stride(0),
                                **shape)


@triton_kernel
def _scalar_decode_kernel(q, k, v, g, o, pool, slots, has_state, scale, stride_o, H: tl.constexpr,
                          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr):
    i_b, i_hv, i_h, o_k, o_v, m_k, m_v, slot = decode_program(slots, H, HV, K, V, BK, BV)
    p_state, m_state, state = decode_state(pool, slot, i_hv, o_k, o_v, m_k, m_v, tl.load(has_state + i_b) != 0,
                                           HV, K, V)
    b_q = tl.load(q + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + (i_b * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g + i_b * HV + i_hv).to(tl.float32)
    state = state * tl.exp(b_g) + b_k[:, None] * b_v[None, :]
    b_o = tl.sum(state * b_q[:, None], axis=0)
    tl.store(o + i_b * stride_o + i_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_state, state, mask=m_state)
