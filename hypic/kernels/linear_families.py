"""The linear-mixer families of PIC algebra (DESIGN §2): one interface, one registry.

Every family has the token recurrence S_t = T_t S_{t-1} + u_t with state S in R^{K x V} per value
head (FLA layout [.., HV, K, V]; T acts on the K dim) and output o_t = S_t^T (scale q_t). What a
family fixes is the form of T_t, hence how a segment's cumulative T_C = T_last ... T_first is stored:

| name     | kind     | T_t                                   | u_t           | stored T per head      |
|----------|----------|---------------------------------------|---------------|------------------------|
| scalar   | scalar   | exp(g_t) I                            | k v^T         | sum g (log), []        |
| diagonal | diagonal | Diag(exp(g_t))                        | k v^T         | sum g (log), [K]       |
| gdn      | dense    | exp(g_t) (I - b_t k k^T)              | b_t k v^T     | T_C, [K, K]            |
| kda      | dense    | (I - b_t k k^T) Diag(exp(g_t))        | b_t k v^T     | T_C, [K, K]            |

Tensor conventions (one sequence or a flat varlen batch): q, k [L, H, K] (key heads; value head hv
reads key head hv // (HV // H)); v [L, HV, V]; g [L, HV] (scalar, gdn) or [L, HV, K] (diagonal,
kda), log-space; beta [L, HV] (dense families; None otherwise). A stored T has shape
[.., HV, *t_shape(K)]. Math runs in the promoted dtype of the inputs, so float64 in gives an exact
oracle.
"""
from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from hypic.kernels.host_copy import host_to_device
from hypic.errors import UnsupportedModelError
from hypic.kernels.gdn import gated_delta_rule
from hypic.kernels.gdn_tuples import gdn_span_tuples
from hypic.kernels.kda_rule import kda_rule
from hypic.kernels.scalar_gated import scalar_gated_rule
from hypic.kernels.scatter_kv import apply_rope
from hypic.kernels.span_states import span_tuples
from hypic.kernels.varlen import Operands, RowSpans, StateSpans


class LinearFamily(ABC):
    """One family of linear mixers: its transition, its cached T, and the algebra on both."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "scalar" | "diagonal" | "dense"
    gate_per_key: ClassVar[bool]  # g carries a K dim (diagonal, kda)
    log_T: ClassVar[bool]  # stored T is a sum of log gates (scalar, diagonal): keep it in float32
    # its chunked prefill and tuple kernels are checked inside CUDA graphs (hypic.engine.pic.cold_graphs)
    # on the H200; the others' cold chunks run eagerly
    prefill_graphs: ClassVar[bool] = False

    # --- per-family math ------------------------------------------------------------------------
    @abstractmethod
    def t_shape(self, key_dim: int) -> tuple[int, ...]:
        """Shape of the stored T of one head."""

    @abstractmethod
    def step(self, state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor | None) -> torch.Tensor:
        """One token, all heads: state [HV, K, V], k [HV, K], v [HV, V], g [HV(, K)], beta [HV]."""

    @abstractmethod
    def token_T(self, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None) -> torch.Tensor:
        """Stored form of one token's T_t (k [HV, K]): the explicit factor the tests multiply out."""

    @abstractmethod
    def apply_T(self, T: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """T . state for T [.., HV, *t_shape] and state [.., HV, K, V]."""

    @abstractmethod
    def combine_T(self, later: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
        """Stored form of the product later . earlier (T of two consecutive spans)."""

    @abstractmethod
    def as_matrix(self, T: torch.Tensor, key_dim: int) -> torch.Tensor:
        """T as explicit [.., HV, K, K] matrices."""

    # --- shared algebra -----------------------------------------------------------------------
    def t_storage_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        """Dtype of cached T beside states cached in `state_dtype`: log-gate sums stay float32, as bf16
        would err by up to 2^-8 relative *in the exponent*."""
        return torch.float32 if self.log_T else state_dtype

    def t_bytes(self, key_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one head's stored T."""
        return math.prod(self.t_shape(key_dim)) * dtype.itemsize

    def identity_T(self, heads: int, key_dim: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> torch.Tensor:
        """Stored form of I (the T of an empty span)."""
        if self.kind == "dense":
            return torch.eye(key_dim, dtype=dtype, device=device).expand(heads, key_dim, key_dim).clone()
        return torch.zeros(heads, *self.t_shape(key_dim), dtype=dtype, device=device)

    def compose(self, T: torch.Tensor, S0: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The state after a cached span: T . state + S0."""
        return self.apply_T(T, state) + S0

    def recur(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor | None, *, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-by-token over one sequence from `state` [HV, K, V]; returns (o [L, HV, V], final)."""
        heads = v.shape[1]
        q, k, v, g, beta = _cast(state.dtype, expand_heads(q, heads), expand_heads(k, heads), v, g, beta)
        outputs = []
        for t in range(v.shape[0]):
            state = self.step(state, k[t], v[t], g[t], None if beta is None else beta[t])
            outputs.append(torch.einsum("hkv,hk->hv", state, q[t] * scale))
        return _stack(outputs, v), state

    def run(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            g: torch.Tensor, beta: torch.Tensor | None, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as `recur` by the fastest exact path: here the token loop itself."""
        return self.recur(state, q, k, v, g, beta, scale=scale)

    def recur_spans(self, x: Operands, pool: torch.Tensor, spans: StateSpans, *, scale: float) -> torch.Tensor:
        """The varlen path a mixer's layer runs: span b from pool[slots[b]] (zeros without state),
        its end state written back there; returns o [N, HV, V] in v's dtype. Here span by span
        through `run` (a family with a chunked kernel overrides it)."""
        o = torch.empty_like(x.v)
        slots, has_state = spans.slots.tolist(), spans.has_state.tolist()
        for b, (start, end) in enumerate(_spans(spans.seq_lens)):
            state = pool[slots[b]] if has_state[b] else torch.zeros_like(pool[0])
            rows = slice(start, end)
            beta = None if x.beta is None else x.beta[rows]
            o[rows], pool[slots[b]] = self.run(state, x.q[rows], x.k[rows], x.v[rows], x.g[rows], beta, scale=scale)
        return o

    def _kernel(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, pool: Tensor,
                cu_seqlens: Tensor, seq_lens: tuple[int, ...], scale: float) -> Tensor:
        """Sequence b of the varlen batch runs from pool[b] through `recur_spans` and leaves its end state there."""
        return self.recur_spans(Operands(q, k, v, g.float(), beta), pool,
                                pool_spans(pool.shape[0], cu_seqlens.to(pool.device, torch.int32), seq_lens),
                                scale=scale)

    def final_states(self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor | None, initial: torch.Tensor,
                     cu_seqlens: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:
        """End state of every span of a varlen batch, span b starting from initial[b];
        `seq_lens` are the spans' lengths on the host (cu_seqlens' differences)."""
        k, v, g, beta = _cast(initial.dtype, expand_heads(k, v.shape[1]), v, g, beta)
        ends = []
        for b, (start, end) in enumerate(_spans(seq_lens)):
            state = initial[b]
            for t in range(start, end):
                state = self.step(state, k[t], v[t], g[t], None if beta is None else beta[t])
            ends.append(state)
        return torch.stack(ends)

    @abstractmethod
    def extract_tuple(self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor | None, cu_seqlens: torch.Tensor,
                      seq_lens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(T [B, HV, *t_shape], S0 [B, HV, K, V]) of every span of a varlen batch; S0 is the end state
        from zero. `seq_lens`: the spans' lengths on the host (cu_seqlens' differences; reading those
        back would sync a GPU)."""

    @abstractmethod
    def spans_tuple(self, x: Operands, spans: RowSpans) -> tuple[torch.Tensor, torch.Tensor]:
        """`extract_tuple` of spans of a flat batch's rows (cold interiors in a step)."""


class LogGateFamily(LinearFamily):
    """Families whose T_t is exp(g_t) on the identity or a diagonal: T_C is the sum of log gates and
    S0 a closed-form sum of decayed k v^T, one weighted GEMM per span and head (`span_tuples`)."""

    log_T = True

    def extract_tuple(self, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, cu_seqlens: Tensor,
                      seq_lens: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """float64 keeps the token recurrence (the exact oracle); any other dtype takes `span_tuples`."""
        if k.dtype != torch.float64:
            return span_tuples(k, v, g, RowSpans.packed(cu_seqlens, seq_lens))
        zeros = torch.zeros(len(seq_lens), v.shape[1], k.shape[-1], v.shape[2], dtype=k.dtype, device=v.device)
        return segment_sum(g.double(), cu_seqlens), super().final_states(k, v, g, beta, zeros, cu_seqlens, seq_lens)

    def spans_tuple(self, x: Operands, spans: RowSpans) -> tuple[Tensor, Tensor]:
        """In place: k and v are read span by span as slices of the flat batch (float64: the rows gathered
        for the token recurrence)."""
        if x.k.dtype != torch.float64:
            return span_tuples(x.k, x.v, x.g, spans)
        rows = spans.rows
        beta = None if x.beta is None else x.beta[rows]
        return self.extract_tuple(x.k[rows], x.v[rows], x.g[rows], beta, spans.cu_seqlens, spans.lens)

    def final_states(self, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, initial: Tensor,
                     cu_seqlens: Tensor, seq_lens: tuple[int, ...]) -> Tensor:
        """float64: the token recurrence; otherwise T . initial + S0 from the closed form."""
        if initial.dtype == torch.float64:
            return super().final_states(k, v, g, beta, initial, cu_seqlens, seq_lens)
        T, S0 = self.extract_tuple(k, v, g, beta, cu_seqlens, seq_lens)
        return self.compose(T, S0, initial.float())


class ScalarFamily(LogGateFamily):
    """T_t = exp(g_t) I: Mamba2, lightning attention, RetNet (FLA simple_gla)."""

    name, kind, gate_per_key = "scalar", "scalar", False

    def t_shape(self, key_dim: int) -> tuple[int, ...]:
        return ()

    def step(self, state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return g.exp()[:, None, None] * state + k[:, :, None] * v[:, None, :]

    def token_T(self, k: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return g

    def apply_T(self, T: Tensor, state: Tensor) -> Tensor:
        return T.exp()[..., None, None].to(state.dtype) * state

    def combine_T(self, later: Tensor, earlier: Tensor) -> Tensor:
        return later + earlier

    def as_matrix(self, T: Tensor, key_dim: int) -> Tensor:
        return T.exp()[..., None, None] * torch.eye(key_dim, dtype=T.dtype, device=T.device)

    def recur_spans(self, x: Operands, pool: Tensor, spans: StateSpans, *, scale: float) -> Tensor:
        return scalar_gated_rule(x.q, x.k, x.v, x.g, pool, spans.slots, spans.has_state, spans.cu_seqlens,
                                 scale=scale, num_decodes=spans.num_decodes, seq_lens_cpu=spans.seq_lens)

    # Spans run chunk by chunk (SSD form, Mamba2's "state space duality"): inside a chunk the outputs are
    # a decay-masked attention plus the decayed carried-in state, and the state moves once per chunk.

    def run(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, *,
            scale: float) -> tuple[Tensor, Tensor]:
        q, k, v, g, state = self._operands(state, q, k, v, g)
        outputs = []
        for c in _chunks(v.shape[0]):
            o, state = _scalar_chunk(state, q[c], k[c], v[c], g[c], scale)
            outputs.append(o)
        return (torch.cat(outputs) if outputs else v.new_zeros(v.shape)), state

    @staticmethod
    def _operands(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> tuple[Tensor | None, ...]:
        """Key heads expanded to the value heads, everything in the math dtype (at least float32)."""
        dtype, heads = torch.promote_types(state.dtype, torch.float32), v.shape[1]
        return _cast(dtype, expand_heads(q, heads), expand_heads(k, heads), v, g, state)

    def rotate_state(self, state: torch.Tensor, delta: torch.Tensor | int,
                     inv_freq: torch.Tensor) -> torch.Tensor:
        """S_C|b = R(b - a) S_C|a (paper eq. 7) for RoPE applied to k inside the layer: rotates the
        K dim of state [.., K, V] by `delta` = b - a positions (an int, or a tensor broadcastable
        to state.shape[:-2]). Exact for this family only: exp(g) I commutes with rotations."""
        delta = torch.as_tensor(delta, device=state.device)
        rotated = apply_rope(state.transpose(-1, -2), delta[..., None], inv_freq)
        return rotated.transpose(-1, -2)


class DiagonalFamily(LogGateFamily):
    """T_t = Diag(exp(g_t)): GLA."""

    name, kind, gate_per_key = "diagonal", "diagonal", True

    def t_shape(self, key_dim: int) -> tuple[int, ...]:
        return (key_dim,)

    def step(self, state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return g.exp()[:, :, None] * state + k[:, :, None] * v[:, None, :]

    def token_T(self, k: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return g

    def apply_T(self, T: Tensor, state: Tensor) -> Tensor:
        return T.exp()[..., None].to(state.dtype) * state

    def combine_T(self, later: Tensor, earlier: Tensor) -> Tensor:
        return later + earlier

    def as_matrix(self, T: Tensor, key_dim: int) -> Tensor:
        return torch.diag_embed(T.exp())


class DenseFamily(LinearFamily):
    """Delta-rule families: T_t = (I - b k k^T) with a gate on one side, stored as a K x K matrix."""

    kind, log_T = "dense", False

    def t_shape(self, key_dim: int) -> tuple[int, ...]:
        return (key_dim, key_dim)

    def apply_T(self, T: Tensor, state: Tensor) -> Tensor:
        return T.to(state.dtype) @ state

    def combine_T(self, later: Tensor, earlier: Tensor) -> Tensor:
        return later @ earlier

    def as_matrix(self, T: Tensor, key_dim: int) -> Tensor:
        return T

    # The family's chunked kernel (`recur_spans`: FLA on cuda, chunked torch reference on cpu) runs spans
    # and tuple extraction; float64 keeps the token recurrence, the exact oracle (the kernel's state is float32).

    def run(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, *,
            scale: float) -> tuple[Tensor, Tensor]:
        if state.dtype == torch.float64:
            return self.recur(state, q, k, v, g, beta, scale=scale)
        pool = state[None].to(torch.float32, copy=True)
        cu_seqlens = host_to_device([0, v.shape[0]], torch.int32, pool.device)
        o = self._kernel(q, k, v, g, beta, pool, cu_seqlens, (v.shape[0],), scale)
        return o, pool[0]

    def final_states(self, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, initial: Tensor,
                     cu_seqlens: Tensor, seq_lens: tuple[int, ...]) -> Tensor:
        """float64: the token recurrence; otherwise the family's varlen kernel (one launch set per call,
        not a loop over spans and chunks), from float32 copies of `initial`."""
        if initial.dtype == torch.float64:
            return super().final_states(k, v, g, beta, initial, cu_seqlens, seq_lens)
        pool = initial.to(torch.float32, copy=True).contiguous()
        self._kernel(k, k, v, g, beta, pool, cu_seqlens, seq_lens, 1.0)
        return pool

    def spans_tuple(self, x: Operands, spans: RowSpans) -> tuple[Tensor, Tensor]:
        """The interior rows of v gathered straight into [v | 0] (one copy, not a gather and a cat)."""
        rows, (heads, value_dim), key_dim = spans.rows, x.v.shape[1:], x.k.shape[-1]
        values = x.v.new_zeros(rows.numel(), heads, value_dim + key_dim)
        torch.index_select(x.v, 0, rows, out=values[..., :value_dim])
        beta = None if x.beta is None else x.beta[rows]
        return self._tuple_of_values(x.k[rows], values, value_dim, x.g[rows], beta, spans.cu_seqlens, spans.lens)

    def extract_tuple(self, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, cu_seqlens: Tensor,
                      seq_lens: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """Both from one pass of `final_states`: T is the end state from I with v = 0 (value dim K),
        since (prod T_t) I = T_C."""
        # value columns recur independently, so [v | 0] from [0 | I] ends at [S0 | T]
        values = torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], k.shape[-1])], -1)
        return self._tuple_of_values(k, values, v.shape[2], g, beta, cu_seqlens, seq_lens)

    def _tuple_of_values(self, k: Tensor, values: Tensor, value_dim: int, g: Tensor, beta: Tensor | None,
                         cu_seqlens: Tensor, seq_lens: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """(T, S0) as views of the end states of `values` = [v | 0] ([N, HV, V + K]) from [0 | I]."""
        num, heads, key_dim = cu_seqlens.numel() - 1, values.shape[1], k.shape[-1]
        dtype = torch.promote_types(k.dtype, torch.float32)
        zeros = torch.zeros(num, heads, key_dim, value_dim, dtype=dtype, device=values.device)
        eye = self.identity_T(heads, key_dim, dtype, values.device).expand(num, -1, -1, -1)
        both = self.final_states(k, values, g, beta, torch.cat([zeros, eye], -1), cu_seqlens, seq_lens)
        return both[..., value_dim:], both[..., :value_dim]

    @staticmethod
    def _delta_write(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
        """(I - b k k^T) state + b k v^T, without forming the K x K matrix."""
        recalled = torch.einsum("hk,hkv->hv", k, state)
        return state + k[:, :, None] * ((v - recalled) * beta[:, None])[:, None, :]

    @staticmethod
    def _householder(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        return eye - beta[:, None, None] * k[:, :, None] * k[:, None, :]


class GatedDeltaFamily(DenseFamily):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): T_t = exp(g_t) (I - b_t k_t k_t^T)."""

    name, gate_per_key = "gdn", False
    prefill_graphs = True

    def step(self, state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return self._delta_write(g.exp()[:, None, None] * state, k, v, beta)

    def token_T(self, k: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return g.exp()[:, None, None] * self._householder(k, beta)

    def extract_tuple(self, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, cu_seqlens: Tensor,
                      seq_lens: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        if k.dtype == torch.float64:
            return super().extract_tuple(k, v, g, beta, cu_seqlens, seq_lens)
        return gdn_span_tuples(k, v, g, beta, RowSpans.packed(cu_seqlens, seq_lens))

    def spans_tuple(self, x: Operands, spans: RowSpans) -> tuple[Tensor, Tensor]:
        """The ordered product of each span's chunk factors (`gdn_span_tuples`), rows read in place;
        float64 keeps the token recurrence (the exact oracle)."""
        if x.k.dtype == torch.float64:
            return super().spans_tuple(x, spans)
        return gdn_span_tuples(x.k, x.v, x.g, x.beta, spans)

    def recur_spans(self, x: Operands, pool: Tensor, spans: StateSpans, *, scale: float) -> Tensor:
        return gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, pool, spans.slots, spans.has_state, spans.cu_seqlens,
                                scale=scale, num_decodes=spans.num_decodes, seq_lens_cpu=spans.seq_lens)


class KimiDeltaFamily(DenseFamily):
    """Kimi Delta Attention (Kimi-Linear): T_t = (I - b_t k_t k_t^T) Diag(exp(g_t))."""

    name, gate_per_key = "kda", True

    def step(self, state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return self._delta_write(g.exp()[:, :, None] * state, k, v, beta)

    def token_T(self, k: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
        return self._householder(k, beta) * g.exp()[:, None, :]

    def recur_spans(self, x: Operands, pool: Tensor, spans: StateSpans, *, scale: float) -> Tensor:
        return kda_rule(x.q, x.k, x.v, x.g, x.beta, pool, spans.slots, spans.has_state, spans.cu_seqlens,
                        scale=scale, num_decodes=spans.num_decodes, seq_lens_cpu=spans.seq_lens)


FAMILIES: dict[str, LinearFamily] = {
    family.name: family for family in (ScalarFamily(), DiagonalFamily(), GatedDeltaFamily(), KimiDeltaFamily())
}


def get_family(name: str) -> LinearFamily:
    """The family registered under `name` ("scalar", "diagonal", "gdn", "kda")."""
    if name not in FAMILIES:
        raise UnsupportedModelError(f"linear family {name!r} is unknown; hypic knows {', '.join(FAMILIES)}")
    return FAMILIES[name]


def pool_spans(num: int, cu_seqlens: Tensor, seq_lens: tuple[int, ...]) -> StateSpans:
    """Spans of a varlen batch over a pool of their own: span b over slot b, from its state there."""
    device = cu_seqlens.device
    return StateSpans(torch.arange(num, device=device), torch.ones(num, dtype=torch.bool, device=device),
                      cu_seqlens, 0, seq_lens)


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[.., H, K] key-head tensor -> [.., heads, K]: value head hv reads key head hv // (heads // H)."""
    return x.repeat_interleave(heads // x.shape[-2], dim=-2) if x.shape[-2] != heads else x


def segment_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum over each span of a varlen batch: x [N, ...] -> [B, ...] (empty spans give 0).
    Summed per span, not as differences of one running cumsum, which loses float32 precision."""
    lengths = cu_seqlens.long().diff()
    span_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths,
                                            output_size=x.shape[0])  # sized on the host: no sync
    return x.new_zeros(lengths.numel(), *x.shape[1:]).index_add_(0, span_of_token, x)


SCALAR_CHUNK = 64  # tokens per chunk of the scalar family's chunked paths


def _chunks(length: int) -> list[slice]:
    return [slice(start, min(start + SCALAR_CHUNK, length)) for start in range(0, length, SCALAR_CHUNK)]


def _scalar_chunk(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  scale: float) -> tuple[Tensor, Tensor]:
    """One chunk of C tokens from `state` [HV, K, V] (q, k [C, HV, K], v [C, HV, V], g [C, HV]):
    o_t = scale (exp(b_t) q_t^T S + sum_{s<=t} exp(b_t - b_s) (q_t . k_s) v_s), b the running gate sum."""
    b = g.cumsum(0)
    causal = torch.ones(len(g), len(g), dtype=torch.bool, device=g.device).tril()
    decay = torch.where(causal[:, :, None], b[:, None, :] - b[None, :, :], -math.inf).exp()  # [t, s, HV]
    scores = torch.einsum("thk,shk->tsh", q, k) * decay
    o = torch.einsum("tsh,shv->thv", scores, v) + b.exp()[:, :, None] * torch.einsum("thk,hkv->thv", q, state)
    return o * scale, _scalar_chunk_end(state, k, v, b)


def _scalar_chunk_end(state: Tensor, k: Tensor, v: Tensor, b: Tensor) -> Tensor:
    """The state after a chunk: exp(b_C) S + sum_s exp(b_C - b_s) k_s v_s^T."""
    return b[-1].exp()[:, None, None] * state + torch.einsum("sh,shk,shv->hkv", (b[-1] - b).exp(), k, v)


def _cast(dtype: torch.dtype, *xs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Inputs in the state's dtype, so gates are exponentiated at full precision."""
    return tuple(None if x is None else x.to(dtype) for x in xs)


def _spans(seq_lens: tuple[int, ...]) -> list[tuple[int, int]]:
    return list(itertools.pairwise(itertools.accumulate(seq_lens, initial=0)))


def _stack(outputs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not outputs:
        return like.new_zeros(like.shape)
    return torch.stack(outputs)
