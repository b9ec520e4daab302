"""Random varlen batches and float64 oracles shared by the kernel tests."""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

# Triton kernels run on the CPU through the interpreter only on request (slow; keep such cases tiny)
interpreted = pytest.mark.skipif(os.environ.get("HYPIC_TRITON_INTERPRET") != "1",
                                 reason="set HYPIC_TRITON_INTERPRET=1 to run Triton kernels in the interpreter")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@dataclass(frozen=True)
class Varlen:
    """A flat batch: decodes (one token each) first, then prefill sequences."""

    seq_lens: tuple[int, ...]
    num_decodes: int
    slots: torch.Tensor  # [B] int64, distinct
    has_state: torch.Tensor  # [B] bool

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor(self.starts, dtype=torch.int32)

    @property
    def starts(self) -> list[int]:
        return list(itertools.accumulate(self.seq_lens, initial=0))

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


def make_varlen(prefill_lens: tuple[int, ...], num_decodes: int, num_slots: int, gen: torch.Generator,
                fresh: tuple[int, ...] = ()) -> Varlen:
    """Sequences `fresh` (indices) start from a zero state; decodes always have state."""
    lens = (1,) * num_decodes + prefill_lens
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)]
    has_state = torch.tensor([b not in fresh for b in range(len(lens))])
    return Varlen(lens, num_decodes, slots, has_state)


@dataclass(frozen=True)
class GdnInputs:
    q: torch.Tensor  # [N, H, K], l2-normalised
    k: torch.Tensor
    v: torch.Tensor  # [N, HV, V]
    g: torch.Tensor  # [N, HV] float32 log-decay
    beta: torch.Tensor  # [N, HV]

    def to(self, device: str, dtype: torch.dtype) -> GdnInputs:
        return GdnInputs(*(t.to(device, dtype) for t in (self.q, self.k, self.v)),
                         self.g.to(device), self.beta.to(device, dtype))


def make_gdn_inputs(num_tokens: int, heads: int, value_heads: int, key_dim: int, value_dim: int,
                    gen: torch.Generator) -> GdnInputs:
    q = F.normalize(torch.randn(num_tokens, heads, key_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(num_tokens, heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(num_tokens, value_heads, value_dim, generator=gen)
    g = F.logsigmoid(2 * torch.randn(num_tokens, value_heads, generator=gen))
    beta = torch.rand(num_tokens, value_heads, generator=gen)
    return GdnInputs(q, k, v, g, beta)


def gdn_recurrence_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token float64 gated delta rule of one sequence. q, k [T, H, K]; v [T, HV, V];
    state [HV, K, V]. Value head hv reads key head hv // (HV // H)."""
    ratio = v.shape[1] // q.shape[1]
    s = state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        for hv in range(v.shape[1]):
            kt = k[t, hv // ratio].double()
            a, b = g[t, hv].double().exp(), beta[t, hv].double()
            s[hv] = a * (s[hv] - b * torch.outer(kt, kt @ s[hv])) + b * torch.outer(kt, v[t, hv].double())
        outs.append(torch.einsum("hkv,hk->hv", s, torch.stack(
            [q[t, hv // ratio].double() for hv in range(v.shape[1])]) * scale))
    return torch.stack(outs), s


@dataclass(frozen=True)
class PagedBatch:
    """Dense per-sequence K/V scattered into shuffled pages, plus the queries of this step."""

    q: torch.Tensor  # [N, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    kv_lens: torch.Tensor  # [B] int32
    positions: torch.Tensor  # [N] int64
    cu_seqlens: torch.Tensor  # [B+1] int32
    seq_lens: tuple[int, ...]
    dense_k: list[torch.Tensor]  # per sequence [kv_len, Hkv, D]
    dense_v: list[torch.Tensor]


def make_paged(kv_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
               gen: torch.Generator, dtype: torch.dtype = torch.float32) -> PagedBatch:
    """Sequence b's queries are its last q_lens[b] positions (a decode or a chunk continuing KV
    already in the pages); pages are drawn at random from a shuffled pool with spare blocks."""
    blocks = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    used = list(itertools.accumulate(blocks, initial=0))
    for b, n in enumerate(blocks):
        tables[b, :n] = order[used[b]:used[b] + n].to(torch.int32)
    dense_k = [k_cache[tables[b, :blocks[b]].long()].flatten(0, 1)[:n] for b, n in enumerate(kv_lens)]
    dense_v = [v_cache[tables[b, :blocks[b]].long()].flatten(0, 1)[:n] for b, n in enumerate(kv_lens)]
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(kv_lens, q_lens)])
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor(list(itertools.accumulate(q_lens, initial=0)), dtype=torch.int32)
    return PagedBatch(q, k_cache, v_cache, tables, torch.tensor(kv_lens, dtype=torch.int32), positions, cu,
                      tuple(q_lens), dense_k, dense_v)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Float64 softmax attention of one sequence's queries over its unpaged K/V; GQA by grouping."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("thd,jhd->htj", q.double(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= positions[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htj,jhd->thd", probs, v)


def conv_loop_f64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor,
                  activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token depthwise causal conv of one sequence: x [T, D], window [D, W-1] (oldest first).
    Returns (y [T, D], final window)."""
    window, outs = window.double(), []
    for t in range(x.shape[0]):
        inputs = torch.cat([window, x[t, :, None].double()], 1)  # [D, W]
        y = (inputs * weight.double()).sum(1) + (0 if bias is None else bias.double())
        outs.append(F.silu(y) if activation == "silu" else y)
        window = inputs[:, 1:]
    return torch.stack(outs) if outs else x.double()[:0], window


def moe_dense_f64(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Per token, per chosen expert, in float64; relu2 experts have up rows only."""
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for weight, expert in zip(topk_weights[n].tolist(), topk_ids[n].tolist()):
            h = w_gate_up[expert].double() @ x[n].double()
            act = F.relu(h) ** 2 if activation == "relu2" else F.silu(h[:inter]) * h[inter:]
            out[n] += weight * (w_down[expert].double() @ act)
    return out


def check_spans_against_recurrence(recurrence, inputs: tuple[torch.Tensor, ...], vl: Varlen, before: torch.Tensor,
                                   after: torch.Tensor, o: torch.Tensor, scale: float) -> None:
    """Every span's outputs and end state (slot after) equal `recurrence(*span inputs, initial state,
    scale)` (float64) from its slot's state before (zeros without state); other slots are untouched."""
    for b, slot in enumerate(vl.slots.tolist()):
        s, e = vl.starts[b], vl.starts[b + 1]
        initial = before[slot] if vl.has_state[b] else torch.zeros_like(before[slot])
        ref_o, ref_state = recurrence(*(x[s:e] for x in inputs), initial, scale)
        torch.testing.assert_close(o[s:e].double(), ref_o, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(after[slot].double(), ref_state, rtol=1e-4, atol=1e-5)
    untouched = torch.ones(before.shape[0], dtype=torch.bool)
    untouched[vl.slots] = False
    assert torch.equal(after[untouched], before[untouched])
