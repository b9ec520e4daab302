"""PIC assembly at one linear layer: compose cached tuples and recur through recompute tokens.

For each request of a batch the running state walks the request's pieces in order (DESIGN §3.5):
at a cached piece S <- T . S + S0 (the segment's interior tuple); through recompute tokens
(seam windows, the query) it recurs token by token, S_t = T_t S_{t-1} + u_t, emitting
o_t = S_t^T (scale q_t) for the layer above. A batch without cached pieces is an ordinary
linear-attention prefill.

Flat input layout (a ForwardBatch plus a piece table; B requests, N tokens, P cached pieces):

- Tokens, exactly as for `gated_delta_rule`: the recompute tokens of request b are rows
  cu_seqlens[b]:cu_seqlens[b+1] (int32 [B+1]) of q, k [N, H, K] (l2-normalised by the caller for
  the delta-rule families), v [N, HV, V], g [N, HV] or [N, HV, K] (log gates, per the family),
  beta [N, HV] (dense families, sigmoid applied; None otherwise). Cached interiors are not tokens.
- State: request b starts from ssm_pool[slots[b]] ([S, HV, K, V] float32) if has_state[b] else
  from zeros; its final state is written back to ssm_pool[slots[b]] in place.
- Cached pieces (`CachedPieces`): request b's pieces are rows ptr[b]:ptr[b+1] (int32 [B+1]) in walk
  order. Piece p is composed right before the token at flat index at[p] (int32 [P]), with
  cu_seqlens[b] <= at[p] <= cu_seqlens[b+1]; at[p] == cu_seqlens[b+1] composes after the last token
  (a chunk may end on cached pieces, and a request with no tokens this step may still compose).
  Within a request at[] is non-decreasing; pieces with equal at[] compose in row order.
- Checkpoints (optional, `StateCheckpoints`): request b saves its state just before the token at
  flat index at[b] (int64 [B], -1 for none; a token after its last piece) into ssm_pool[slots[b]],
  so a prefix-cache checkpoint one token short of the chunk's end costs no second step.
- Tuples, read in place from the segment store's arena: piece p's T block [HV, *t_shape] is
  contiguous at t_src[t_off[p]] and its S0 [HV, K, V] at s0_src[s0_off[p]] (t_src, s0_src 1-D;
  t_off, s0_off int64 [P], element offsets for *this layer*; see `CachedPieces.shifted`). A dense T's
  offset is a multiple of 16 elements where K is a multiple of 4 (the segment store aligns blocks at
  256 bytes, and layers and heads are K x K apart); the kernel relies on it for 16-byte loads.
  Log-gate T (scalar, diagonal) is float32; dense T and S0 are float32 or bfloat16. A bf16 dense T
  goes to the tensor cores as stored, against the state in two bf16 parts; a float32 one is split
  for three tf32 MMAs (a walk's state within ~3e-6 and ~2e-7 of the reference's, which composes
  with T.float()).

Returns o [N, HV, V] in v's dtype. cuda tensors run the Triton kernel (one program per request x
value head x V tile walking compose -> seam tokens -> compose ...; compiled on first use, see
triton_lazy); others the torch reference.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hypic.kernels.host_copy import host_to_device
from hypic.kernels.linear_families import LinearFamily
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use

FAMILY_CODES: dict[str, int] = {"scalar": 0, "diagonal": 1, "gdn": 2, "kda": 3}  # the kernel's FAMILY


@dataclass(frozen=True)
class CachedPieces:
    """The cached-piece table of a batch (see the module docstring)."""

    ptr: torch.Tensor  # [B+1] int32, request b's pieces are rows ptr[b]:ptr[b+1]
    at: torch.Tensor  # [P] int32, flat token index before which the piece is composed
    t_off: torch.Tensor  # [P] int64, element offset of the piece's T block in t_src
    s0_off: torch.Tensor  # [P] int64, element offset of the piece's S0 block in s0_src

    @classmethod
    def build(cls, per_request: Sequence[Sequence[tuple[int, int, int]]],
              device: torch.device | str = "cpu") -> CachedPieces:
        """From (at, t_off, s0_off) rows per request, in walk order (host lists, one copy each)."""
        rows = [row for pieces in per_request for row in pieces]
        ptr = list(itertools.accumulate((len(p) for p in per_request), initial=0))
        columns = list(zip(*rows)) if rows else [(), (), ()]
        return cls(ptr=host_to_device(ptr, torch.int32, device),
                   at=host_to_device(list(columns[0]), torch.int32, device),
                   t_off=host_to_device(list(columns[1]), torch.int64, device),
                   s0_off=host_to_device(list(columns[2]), torch.int64, device))

    @classmethod
    def empty(cls, num_seqs: int, device: torch.device | str = "cpu") -> CachedPieces:
        return cls.build([[] for _ in range(num_seqs)], device)

    def shifted(self, t_shift: int, s0_shift: int) -> CachedPieces:
        """The same pieces at another layer: offsets moved by that layer's place in each entry."""
        return CachedPieces(self.ptr, self.at, self.t_off + t_shift, self.s0_off + s0_shift)

    @property
    def num_pieces(self) -> int:
        return int(self.at.numel())


@dataclass(frozen=True)
class StateCheckpoints:
    """Per request: save the state before flat token at[b] (-1: never) into pool slot slots[b]."""

    at: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64


def compose_and_recur(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor | None, ssm_pool: torch.Tensor, slots: torch.Tensor,
                      has_state: torch.Tensor, cu_seqlens: torch.Tensor, pieces: CachedPieces,
                      t_src: torch.Tensor, s0_src: torch.Tensor, *, family: LinearFamily,
                      scale: float, checkpoints: StateCheckpoints | None = None) -> torch.Tensor:
    """Walk every request's pieces (module docstring); returns o [N, HV, V]."""
    walk = compose_and_recur_triton if v.device.type == "cuda" else compose_and_recur_ref
    return walk(q, k, v, g, beta, ssm_pool, slots, has_state, cu_seqlens, pieces, t_src, s0_src,
                family=family, scale=scale, checkpoints=checkpoints)


def compose_and_recur_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor | None, ssm_pool: torch.Tensor, slots: torch.Tensor,
                          has_state: torch.Tensor, cu_seqlens: torch.Tensor, pieces: CachedPieces,
                          t_src: torch.Tensor, s0_src: torch.Tensor, *, family: LinearFamily,
                          scale: float, checkpoints: StateCheckpoints | None = None) -> torch.Tensor:
    """Torch reference of `compose_and_recur`; math in float32, or float64 for a float64 pool."""
    walk = _Walk(family, q, k, v, g, beta, scale, t_src, s0_src)
    bounds, ptr = cu_seqlens.tolist(), pieces.ptr.tolist()
    save_at = [-1] * len(slots) if checkpoints is None else checkpoints.at.tolist()
    save_slots = [] if checkpoints is None else checkpoints.slots.tolist()
    at, t_off, s0_off = pieces.at.tolist(), pieces.t_off.tolist(), pieces.s0_off.tolist()
    math_dtype = torch.promote_types(ssm_pool.dtype, torch.float32)
    for b, slot in enumerate(slots.tolist()):
        state = ssm_pool[slot].to(math_dtype) if bool(has_state[b]) else \
            torch.zeros(ssm_pool.shape[1:], dtype=math_dtype, device=ssm_pool.device)
        cursor = bounds[b]
        for p in range(ptr[b], ptr[b + 1]):
            state = walk.tokens(state, cursor, at[p])
            state = family.compose(*walk.tuple_at(t_off[p], s0_off[p], state.dtype), state)
            cursor = at[p]
        if save_at[b] >= 0:
            state = walk.tokens(state, cursor, save_at[b])
            ssm_pool[save_slots[b]] = state.to(ssm_pool.dtype)
            cursor = save_at[b]
        ssm_pool[slot] = walk.tokens(state, cursor, bounds[b + 1]).to(ssm_pool.dtype)
    return walk.out


class _Walk:
    """The token side of the reference walk: recurrences over spans, outputs collected in `out`."""

    def __init__(self, family: LinearFamily, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor | None, scale: float, t_src: torch.Tensor,
                 s0_src: torch.Tensor) -> None:
        self.family, self.q, self.k, self.v, self.g, self.beta, self.scale = family, q, k, v, g, beta, scale
        self.t_src, self.s0_src = t_src, s0_src
        self.out = torch.empty_like(v)
        heads, key_dim = v.shape[1], k.shape[-1]
        self.t_shape = (heads, *family.t_shape(key_dim))
        self.s0_shape = (heads, key_dim, v.shape[2])

    def tokens(self, state: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Recur tokens [start, end), write their outputs, return the state after them."""
        if end <= start:
            return state
        span = slice(start, end)
        beta = None if self.beta is None else self.beta[span]
        o, state = self.family.run(state, self.q[span], self.k[span], self.v[span], self.g[span],
                                   beta, scale=self.scale)
        self.out[span] = o.to(self.out.dtype)
        return state

    def tuple_at(self, t_off: int, s0_off: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, S0) of a cached piece, read in place from the flat sources, in the math dtype."""
        T = self.t_src[t_off: t_off + math.prod(self.t_shape)].view(self.t_shape)
        S0 = self.s0_src[s0_off: s0_off + math.prod(self.s0_shape)].view(self.s0_shape)
        return T.to(dtype), S0.to(dtype)


# ----------------------------------------------------------------------------- Triton
# One program per (V tile, value head, request) keeps a [K, BV] float32 state tile in registers and
# walks the request. Value columns are independent in every family (T acts on the K dim), so
# tiling V needs no communication between programs. The walk is latency-bound (one request fills
# few SMs; its tokens are sequential), so the launch shape is chosen for the latency of one token.
# The arena of cached tuples is far larger than L2: a head's V tiles prefetch the next piece's T and S0
# between them (a dense T is K x K, read whole by every tile) while the tokens before it run.

@dataclass(frozen=True)
class WalkConfig:
    """Launch shape of the walk kernel: BV value columns and num_warps warps a program."""

    block_v: int
    num_warps: int

    def __post_init__(self) -> None:
        for name in ("block_v", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"WalkConfig.{name} must be a power of two, got {value}")


def walk_config(family: LinearFamily, value_dim: int) -> WalkConfig:
    """The engine's launch shape for a family's heads (scripts/bench_compose.py times the others).

    One warp a program keeps a token's reductions over K in registers and warp shuffles (more
    warps meet at shared memory and barriers, twice a token), and 8 value columns keep the K=128
    tile at 32 registers a thread with 16 programs a head. Narrower tiles would cut a token's work
    again but read every dense T (K x K) once more per program at each compose.
    """
    return WalkConfig(block_v=min(8, next_power_of_2(value_dim)), num_warps=1)


def launch_constants(family: LinearFamily, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                     config: WalkConfig) -> dict[str, int]:
    """The kernel's compile-time constants (shared with scripts/kernel_resources.py)."""
    # KC: columns of T a compose step. Each step waits on its loads, so fewer steps win although 32 columns
    # spill 32 bytes a thread at K=128, BV 8, one warp: a 256-token, 16-piece walk 301 us against 324 at 16
    # (compose_kc_h200_experiment.txt, bench/RESULTS.md). A bf16 T fits 64 without spilling but takes more
    # instructions a compose (scripts/kernel_resources.py --tuple-dtype bfloat16)
    return dict(H=key_heads, HV=value_heads, K=key_dim, V=value_dim, BK=max(16, next_power_of_2(key_dim)),
                BV=config.block_v, KC=32, FAMILY=FAMILY_CODES[family.name])


def compose_and_recur_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor | None, ssm_pool: torch.Tensor, slots: torch.Tensor,
                             has_state: torch.Tensor, cu_seqlens: torch.Tensor, pieces: CachedPieces,
                             t_src: torch.Tensor, s0_src: torch.Tensor, *, family: LinearFamily,
                             scale: float, checkpoints: StateCheckpoints | None = None,
                             config: WalkConfig | None = None) -> torch.Tensor:
    """Launch the Triton kernel; same contract as `compose_and_recur` (config: the launch shape,
    `walk_config`'s by default)."""
    if ssm_pool.dtype != torch.float32:  # a dense compose parks the state in its slot (see _dense_apply)
        raise TypeError(f"compose_and_recur_triton needs a float32 state pool, got {ssm_pool.dtype}")
    num_heads, key_dim = k.shape[1:]
    value_heads, value_dim = v.shape[1:]
    config = config or walk_config(family, value_dim)
    constants = launch_constants(family, num_heads, value_heads, key_dim, value_dim, config)
    o = torch.empty_like(v)
    grid = (-(-value_dim // constants["BV"]), value_heads, slots.numel())
    _compose_recur_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
        g if beta is None else beta.contiguous(), o, ssm_pool, slots, has_state, cu_seqlens,
        pieces.ptr, pieces.at, pieces.t_off, pieces.s0_off, t_src, s0_src, scale,
        slots if checkpoints is None else checkpoints.at, slots if checkpoints is None else checkpoints.slots,
        HAS_CHECKPOINTS=checkpoints is not None, L2_PREFETCH=v.is_cuda, **constants, num_warps=config.num_warps)
    return o


@triton_kernel
def _compose_recur_kernel(q, k, v, g, beta, o, pool, slots, has_state, cu_seqlens,
                          ptr, at, t_off, s0_off, t_src, s0_src, scale, save_at, save_slots,
                          HAS_CHECKPOINTS: tl.constexpr, L2_PREFETCH: tl.constexpr, H: tl.constexpr,
                          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, KC: tl.constexpr, FAMILY: tl.constexpr):
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk, mv = ok < K, ov < V
    # the request's slot at this head: the state's home, its tile read now and written at the end
    home = pool + (tl.load(slots + i_b).to(tl.int64) * HV + i_hv) * K * V
    tile = home + ok[:, None] * V + ov[None, :]
    S = tl.load(tile, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    # where(), not a masked load alone: a recycled slot may hold inf/nan
    S = tl.where(tl.load(has_state + i_b) != 0, S, 0.0)
    # token indices in int64 (N * HV * V may pass 2^31), one loop-carried type whatever the index dtypes
    cursor = tl.load(cu_seqlens + i_b).to(tl.int64)
    # a piece's table row is read an iteration ahead: its loads wait behind the tokens before it,
    # not in front of them, and its tuple is asked into L2 (a GPU hint) before its compose starts
    first, last = tl.load(ptr + i_b), tl.load(ptr + i_b + 1) - 1
    stop_n, t_n, s0_n = _piece(first, first <= last, at, t_off, s0_off)
    if L2_PREFETCH:  # nested, not `and`: a constexpr and a runtime condition
        if first <= last:
            _prefetch_piece(t_n, s0_n, t_src, s0_src, i_v, i_hv, K, V, BV, FAMILY)
    for p in range(first, last + 1):
        stop, t_at, s0_at = stop_n, t_n, s0_n
        stop_n, t_n, s0_n = _piece(p + 1, p < last, at, t_off, s0_off)
        S = _tokens(S, cursor, stop, q, k, v, g, beta, o, scale, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
        if L2_PREFETCH:
            if p < last:
                _prefetch_piece(t_n, s0_n, t_src, s0_src, i_v, i_hv, K, V, BV, FAMILY)
        S = _compose(S, t_at, s0_at, t_src, s0_src, home, i_hv, ok, ov, mk, mv, K, V, KC, FAMILY)
        cursor = stop
    if HAS_CHECKPOINTS:
        save = tl.load(save_at + i_b)
        if save >= 0:  # a token after the last piece: walk up to it, keep the state, go on
            S = _tokens(S, cursor, save, q, k, v, g, beta, o, scale, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
            save_ptrs = pool + (tl.load(save_slots + i_b).to(tl.int64) * HV + i_hv) * K * V \
                + ok[:, None] * V + ov[None, :]
            tl.store(save_ptrs, S, mask=mk[:, None] & mv[None, :])
            cursor = save
    end = tl.load(cu_seqlens + i_b + 1).to(tl.int64)
    S = _tokens(S, cursor, end, q, k, v, g, beta, o, scale, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
    tl.store(tile, S, mask=mk[:, None] & mv[None, :])


@triton_kernel
def _tokens(S, start, stop, q, k, v, g, beta, o, scale, i_h, i_hv, ok, ov,
            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, FAMILY: tl.constexpr):
    """Recur tokens [start, stop), four a step, each token's operands loaded two tokens ahead (a
    load from L2 takes about as long as a token's arithmetic, and one program has no other work to
    hide it) into the registers of operands just used: a rotation `now = next` would be a register
    move that waits on the load it copies. Tokens from `stop` on have zero operands, an identity in
    every family. H200, 256 tokens and 16 pieces: 209 -> 188 us with bf16 T, 243 -> 238 with float32
    T against one token ahead (walk_unroll_h200_s13.txt, bench/RESULTS.md)."""
    a = _load_token(start, stop, q, k, v, g, beta, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
    b = _load_token(start + 1, stop, q, k, v, g, beta, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
    for t in range(start, stop, 4):
        c = _load_token(t + 2, stop, q, k, v, g, beta, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
        S = _token(S, t, stop, a, o, scale, i_hv, ov, HV, V, FAMILY)
        d = _load_token(t + 3, stop, q, k, v, g, beta, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
        S = _token(S, t + 1, stop, b, o, scale, i_hv, ov, HV, V, FAMILY)
        a = _load_token(t + 4, stop, q, k, v, g, beta, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
        S = _token(S, t + 2, stop, c, o, scale, i_hv, ov, HV, V, FAMILY)
        b = _load_token(t + 5, stop, q, k, v, g, beta, i_h, i_hv, ok, ov, H, HV, K, V, FAMILY)
        S = _token(S, t + 3, stop, d, o, scale, i_hv, ov, HV, V, FAMILY)
    return S


@triton_kernel
def _load_token(t, stop, q, k, v, g, beta, i_h, i_hv, ok, ov,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, FAMILY: tl.constexpr):
    """Token t's (k, v, q, g, beta) as stored (`_token` widens them: a conversion here would wait on
    the load); zeros from t == stop on."""
    live = t < stop
    # limits, not `mask & live`: the interpreter turns a vector-and-scalar `&` into int32
    k_lim, v_lim = tl.where(live, K, 0), tl.where(live, V, 0)
    k_t = tl.load(k + (t * H + i_h) * K + ok, mask=ok < k_lim, other=0.0)
    v_t = tl.load(v + (t * HV + i_hv) * V + ov, mask=ov < v_lim, other=0.0)
    q_t = tl.load(q + (t * H + i_h) * K + ok, mask=ok < k_lim, other=0.0)
    if FAMILY == 0 or FAMILY == 2:
        g_t = tl.load(g + t * HV + i_hv, mask=live, other=0.0)
    else:
        g_t = tl.load(g + (t * HV + i_hv) * K + ok, mask=ok < k_lim, other=0.0)
    b_t = 0.0
    if FAMILY >= 2:
        b_t = tl.load(beta + t * HV + i_hv, mask=live, other=0.0)
    return k_t, v_t, q_t, g_t, b_t


@triton_kernel
def _token(S, t, stop, operands, o, scale, i_hv, ov, HV: tl.constexpr, V: tl.constexpr, FAMILY: tl.constexpr):
    """One token: decay D, write (delta rule for dense families), emit o_t = S_t^T (scale q_t).

    The output reads the decayed state before the write, o_t = (D S)^T q + (k . q) v' (scaled), so
    the recall and output reductions over K run side by side; a scalar gate also factors out of
    both, leaving one reduction and a few FMAs on the chain from one state to the next. Tokens
    from `stop` on (zero operands: S passes unchanged) store no output.
    """
    k_t, v_t, q_t, g_t, b_t = operands
    k_t, v_t, q_t, g_t = k_t.to(tl.float32), v_t.to(tl.float32), q_t.to(tl.float32), g_t.to(tl.float32)
    if FAMILY == 1 or FAMILY == 3:  # per-key gates decay the state first
        S = S * tl.exp(g_t)[:, None]
        decay = 1.0
    else:
        decay = tl.exp(g_t)
    out = tl.sum(S * q_t[:, None], axis=0) * (decay * scale)
    if FAMILY >= 2:
        v_t = (v_t - tl.sum(S * k_t[:, None], axis=0) * decay) * b_t.to(tl.float32)
    S = S * decay + k_t[:, None] * v_t[None, :]
    out = out + v_t * (tl.sum(k_t * q_t) * scale)
    tl.store(o + (t * HV + i_hv) * V + ov, out.to(o.dtype.element_ty), mask=ov < tl.where(t < stop, V, 0))
    return S


@triton_kernel
def _piece(p, live, at, t_off, s0_off):
    """Piece p's row of the table: (at, t_off, s0_off), zeros where not live (no row p)."""
    return (tl.load(at + p, mask=live, other=0).to(tl.int64), tl.load(t_off + p, mask=live, other=0),
            tl.load(s0_off + p, mask=live, other=0))


@triton_kernel
def _compose(S, t_at, s0_at, t_src, s0_src, home, i_hv, ok, ov, mk, mv,
             K: tl.constexpr, V: tl.constexpr, KC: tl.constexpr, FAMILY: tl.constexpr):
    """S <- T . S + S0 for the cached piece whose tuple is at t_src[t_at], s0_src[s0_at]."""
    t_base = t_src + t_at
    s0_base = s0_src + s0_at + i_hv * K * V
    S0 = tl.load(s0_base + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    if FAMILY == 0:
        S = S * tl.exp(tl.load(t_base + i_hv).to(tl.float32))
    elif FAMILY == 1:
        T = tl.load(t_base + i_hv * K + ok, mask=mk, other=0.0).to(tl.float32)
        S = S * tl.exp(T)[:, None]
    else:  # a 16-element aligned block start lets T's rows load 16 bytes at a time, not element by element
        T = t_src + tl.multiple_of(t_at + i_hv * K * K, 16 if K % 4 == 0 else 1)
        S = _dense_apply(S, T, home, ok, ov, mk, mv, K, V, KC)
    return S + S0.to(tl.float32)


@triton_kernel
def _prefetch_piece(t_at, s0_at, t_src, s0_src, i_v, i_hv,
                    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, FAMILY: tl.constexpr):
    """Bring a piece's T and S0 at this head from HBM into L2, this program's share of their lines:
    a compose's loads (a dense T's chunks one after another) then wait on L2, not HBM. The arena
    holds far more than L2, so a piece's tuple is cold until its walk reaches it."""
    t_elems: tl.constexpr = 1 if FAMILY == 0 else (K if FAMILY == 1 else K * K)
    _prefetch_share(t_src + t_at + i_hv * t_elems, t_elems, i_v, (V + BV - 1) // BV)
    _prefetch_share(s0_src + s0_at + i_hv * K * V, K * V, i_v, (V + BV - 1) // BV)


@triton_kernel
def _prefetch_share(base, N: tl.constexpr, i_v, NV: tl.constexpr):
    """L2 prefetches of program i_v's share (of NV programs) of the 128-byte lines of N elements at base."""
    LINE: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth  # elements in 128 bytes
    LINES: tl.constexpr = (N + LINE - 1) // LINE
    for m in tl.static_range(0, (LINES + NV - 1) // NV, 32):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [base + _share_lines(m, i_v, LINES, NV) * LINE],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton_kernel
def _share_lines(m, i_v, LINES: tl.constexpr, NV: tl.constexpr):
    """Lines i_v + NV * (m + j), j < 32, of LINES: the NV programs' shares cover every line once;
    lines past the end repeat the last one, so every address lies in the block."""
    return tl.minimum(i_v + NV * (m + tl.arange(0, 32)), LINES - 1)


@triton_kernel
def _dense_apply(S, T, home, ok, ov, mk, mv, K: tl.constexpr, V: tl.constexpr, KC: tl.constexpr):
    """T . S for a dense K x K T, KC columns of T at a time: a whole T in registers spills once a
    program has few warps. S waits in this program's tile of the state's home (no other program
    touches it, and the walk's end overwrites it), read back KC rows at a time."""
    tile = home + ok[:, None] * V + ov[None, :]
    tl.debug_barrier()  # the tile's last readers are done
    tl.store(tile, S, mask=mk[:, None] & mv[None, :])
    tl.debug_barrier()  # rows are read by other threads than wrote them
    kc = tl.arange(0, KC)
    acc = tl.zeros_like(S)
    for c in range(0, K, KC):
        mc = c + kc < K
        T_cols = tl.load(T + ok[:, None] * K + (c + kc)[None, :], mask=mk[:, None] & mc[None, :], other=0.0)
        S_rows = tl.load(home + (c + kc)[:, None] * V + ov[None, :], mask=mc[:, None] & mv[None, :], other=0.0)
        acc = _dot_t(T_cols, S_rows, acc)
    return acc


@triton_kernel
def _dot_t(T_cols, S_rows, acc):
    """acc + T_cols . S_rows to float32 accuracy, by the dtype T is stored in (known at compile time)."""
    if T_cols.dtype == tl.bfloat16:
        return _dot_bf16x2(T_cols, S_rows, acc)
    return _dot_tf32x3(T_cols.to(tl.float32), S_rows, acc)


@triton_kernel
def _dot_bf16x2(a, b, acc):
    """acc + a . b for a bf16 `a`, exact as an MMA operand, and a float32 `b` in two bf16 parts: b's
    residual after them is under 2^-16 of b (one part: 2^-8, ~1e-3 on a walk's state), far below the
    2^-8 by which a stored bf16 T is off its float32 original. No split of `a`, two MMAs against
    tf32x3's three, and a bf16 MMA takes 16 columns of `a` to tf32's 8."""
    b_hi = b.to(tl.bfloat16)
    acc = tl.dot(a, (b - b_hi.to(tl.float32)).to(tl.bfloat16), acc)
    return tl.dot(a, b_hi, acc)


@triton_kernel
def _dot_tf32x3(a, b, acc):
    """acc + a . b to float32 accuracy on tensor cores (tf32 alone costs ~1e-3 relative; the
    "ieee" FMA dot holds its operands in registers and spilled ~7 KB a thread on sm90). A tf32 MMA
    keeps 10 mantissa bits of an operand: the high parts exactly, a low part to 2^-11 of itself.
    Triton's own "tf32x3" rounds both splits with NaN guards, ~6 instructions an element of T and
    most of a compose; masking the bits off takes 2."""
    a_hi, b_hi = _tf32_high(a), _tf32_high(b)
    acc = tl.dot(a_hi, b - b_hi, acc, input_precision="tf32")
    acc = tl.dot(a - a_hi, b_hi, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton_kernel
def _tf32_high(x):
    """x with the 13 mantissa bits below tf32's 10 cleared: exact in tf32, and x - high is exact."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
