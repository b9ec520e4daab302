"""The flat varlen conventions every linear-mixer kernel shares: spans over state slots, and the
operands of a family's recurrence (see `hypic.kernels.linear_families` for their shapes)."""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.host_copy import host_to_device
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use


@dataclass(frozen=True)
class StateSpans:
    """Varlen spans of a flat batch, span b over state slot slots[b] (the first num_decodes are one
    token each): what a linear kernel (conv, recurrence) takes besides its tensors."""

    slots: torch.Tensor  # [B] int64, state-slab slot of each span
    has_state: torch.Tensor  # [B] bool, False: the span starts from a zero state
    cu_seqlens: torch.Tensor  # [B+1] int32, row offsets of the spans
    num_decodes: int
    seq_lens: tuple[int, ...]  # [B] span lengths (host copy)


@dataclass(frozen=True)
class Operands:
    """A linear mixer's inputs to its family's recurrence S_t = T_t S_{t-1} + u_t, o_t = S_t^T (scale q_t),
    one row per token: q, k [N, H, K]; v [N, HV, V]; g [N, HV] or [N, HV, K] (log gates); beta [N, HV]
    or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor | None

    def rows(self, index: torch.Tensor) -> Operands:
        """The operands of some tokens (a gather per tensor)."""
        beta = None if self.beta is None else self.beta[index]
        return Operands(self.q[index], self.k[index], self.v[index], self.g[index], beta)

    def inert_outside(self, keep: torch.Tensor) -> Operands:
        """The rows outside `keep` ([N] bool) made inert: zero q, k, v, log gate and beta, so T_t = I
        and u_t = 0 in every family and they leave any state as it is (selected, not multiplied:
        padding rows may hold anything)."""
        def where(x: torch.Tensor) -> torch.Tensor:
            return torch.where(keep.view(-1, *(1,) * (x.dim() - 1)), x, 0)
        beta = None if self.beta is None else where(self.beta)
        return Operands(where(self.q), where(self.k), where(self.v), where(self.g), beta)


@dataclass(frozen=True)
class RowSpans:
    """Spans of a flat batch's rows, each span's rows consecutive (a cold segment's interior rows in a
    step), and the index tensors over them that every layer of the step shares (built once)."""

    starts: tuple[int, ...]  # [B] flat row of each span's first row (host)
    lens: tuple[int, ...]  # [B] rows of each span (host)
    rows: torch.Tensor  # [R] int64: the spans' flat rows, span after span
    cu_seqlens: torch.Tensor  # [B+1] int32: offsets of the spans in `rows`
    span_ends: torch.Tensor  # [R] int64: for each of `rows`, the end offset (cu_seqlens[b + 1]) of its span

    @classmethod
    def build(cls, starts: tuple[int, ...], lens: tuple[int, ...], device: torch.device | str) -> RowSpans:
        """From the host's starts and lengths: one small copy, the per-row indices expanded on the device."""
        cu = list(itertools.accumulate(lens, initial=0))
        host = host_to_device([*starts, *lens, *cu], torch.long, device)
        starts_t, lens_t, cu_t = host[:len(starts)], host[len(starts):2 * len(starts)], host[2 * len(starts):]
        span = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t, output_size=cu[-1])
        rows = starts_t[span] + torch.arange(cu[-1], device=device) - cu_t[span]
        return cls(tuple(starts), tuple(lens), rows, cu_t.int(), cu_t[1:][span])

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, lens: tuple[int, ...]) -> RowSpans:
        """Spans that tile the rows in order (a packed varlen batch; `lens` its cu_seqlens' differences)."""
        return cls.build(tuple(itertools.accumulate(lens, initial=0))[:-1], lens, cu_seqlens.device)


_capturing = False  # a CUDA graph is being captured (`graph_capture`)
_held: dict = {}  # what `step_cache` returned during a capture: its graph reads it at every replay


def step_cache(fn: Callable) -> Callable:
    """An lru_cache of the index tensors every layer of a step asks for (built on the host, copied
    once). What a CUDA graph's capture asks for is also kept for good: the graph reads it at every
    replay, long after the cache may have dropped (and the allocator reused) it."""
    cached = functools.lru_cache(maxsize=16)(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        result = cached(*args)
        if _capturing:
            _held[(fn.__qualname__, *args)] = result
        return result
    return wrapper


@contextlib.contextmanager
def graph_capture() -> Iterator[None]:
    """Around a CUDA graph's capture: `step_cache` results are kept, and FLA builds its own index
    tensors inside the capture. FLA memoises them by argument identity in a queue of four, so one
    it handed out from an earlier call lives outside the graph's pool and would be freed once the
    queue moves on, while the graph still reads it."""
    global _capturing
    fla_utils = sys.modules.get("fla.utils")  # imported by the warm-up's first FLA call, if any
    old = None if fla_utils is None else fla_utils.FLA_DISABLE_TENSOR_CACHE
    _capturing = True
    if fla_utils is not None:
        fla_utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        _capturing = False
        if fla_utils is not None:
            fla_utils.FLA_DISABLE_TENSOR_CACHE = old


@step_cache
def fla_cu_seqlens(seq_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill spans' offsets from 0, on the device and on the host. FLA builds its chunk indices
    from the host copy (from the device one it would read the lengths back) and copies them over with a
    syncing `.to()`; it keeps them by the arguments' identity, so the same objects for every layer of a
    step (and every step of the same lengths) make that copy once."""
    offsets = list(itertools.accumulate(seq_lens, initial=0))
    return host_to_device(offsets, torch.long, device), torch.tensor(offsets, dtype=torch.long)


def expand_key_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[N, H, K] -> [N, HV, K]: consecutive value heads share a key head (hv // (HV // H))."""
    return x.repeat_interleave(num_value_heads // x.shape[1], dim=1)


def initial_states(ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """Each span's starting state: its slot's, or zeros without state."""
    # where(), not a product: a recycled slot may hold inf/nan that must not leak into a fresh sequence
    return torch.where(has_state[:, None, None, None], ssm_pool[slots], 0.0)


def recurrence_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: tuple[torch.Tensor, ...],
                         ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, *, scale: float,
                         num_decodes: int, seq_lens_cpu: tuple[int, ...], step: Any, sequence: Any) -> torch.Tensor:
    """A torch reference's walk over a varlen batch, float32 math with the key heads expanded to the
    value heads: the decodes as one batched `step`, every other span through `sequence` from its
    slot's state, each final state written back. `gates`: the rule's per-token tensors after v."""
    hv, out_dtype = v.shape[1], v.dtype
    q, k = expand_key_heads(q.float(), hv), expand_key_heads(k.float(), hv)
    v, gates = v.float(), [t.float() for t in gates]
    o, nd = torch.empty(v.shape, dtype=torch.float32, device=v.device), num_decodes
    if nd:
        state = initial_states(ssm_pool, slots[:nd], has_state[:nd])
        o[:nd], ssm_pool[slots[:nd]] = step(q[:nd], k[:nd], v[:nd], *(t[:nd] for t in gates), state, scale)
    starts = list(itertools.accumulate(seq_lens_cpu, initial=0))
    for b, (s, e) in enumerate(itertools.pairwise(starts[nd:]), nd):
        state = initial_states(ssm_pool, slots[b:b + 1], has_state[b:b + 1])[0]
        o[s:e], ssm_pool[slots[b]] = sequence(q[s:e], k[s:e], v[s:e], *(t[s:e] for t in gates), state, scale)
    return o.to(out_dtype)


def to_chunks(x: torch.Tensor, length: int, chunk: int) -> torch.Tensor:
    """One sequence [T, HV, ...] -> [HV, n, chunk, ...], zero-padded at the end (zero tokens, with
    zero log-gates, leave a chunked recurrence's state as is; their outputs are dropped)."""
    pad = (-length) % chunk
    x = x.movedim(0, 1)
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.unflatten(1, (-1, chunk))


def one_token_each(tokens: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """A varlen batch of `tokens` decodes: its cu_seqlens and the keywords the references take with them
    (num_decodes, seq_lens_cpu), for a fused decode step's reference to call the unfused ones."""
    return (torch.arange(tokens + 1, dtype=torch.int32, device=device),
            {"num_decodes": tokens, "seq_lens_cpu": (1,) * tokens})


def decode_launch(q: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, int, int], dict[str, int]]:
    """Grid and shape constants of a one-token-a-sequence recurrence kernel (q [B, H, K], v [B, HV, V]):
    a program per sequence, value head and block of value channels."""
    batch, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    block_v = 16 if batch < 16 else 32  # small batches: more programs to fill the GPU
    grid = (batch, value_heads, -(-value_dim // block_v))
    return grid, {"H": heads, "HV": value_heads, "K": key_dim, "V": value_dim, "BK": next_power_of_2(key_dim),
                  "BV": block_v}


@triton_kernel
def decode_program(slots, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr):
    """Where a program of `decode_launch`'s grid stands: (sequence, value head, its key head, key and
    value channels with their masks, the sequence's slot)."""
    i_b, i_hv = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = tl.program_id(2) * BV + tl.arange(0, BV)
    return i_b, i_hv, i_hv // (HV // H), o_k, o_v, o_k < K, o_v < V, tl.load(slots + i_b).to(tl.int64)


@triton_kernel
def decode_state(pool, slot, i_hv, o_k, o_v, m_k, m_v, keep, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """A `decode_program`'s tile of its sequence's state in float32 (zeros unless `keep`: a new
    sequence's slot may hold anything), with the pointers and mask that store it back."""
    p_state = pool + ((slot * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
    m_state = m_k[:, None] & m_v[None, :]
    return p_state, m_state, tl.where(keep, tl.load(p_state, mask=m_state, other=0.0).to(tl.float32), 0.0)
