"""Mixture-of-experts MLP: y = sum_k w_k * down_e(act_e(x)), e = topk_ids[:, k], where act_e is
SwiGLU's silu(gate_e x) * up_e x ("silu") or Nemotron's ungated relu(up_e x)^2 ("relu2").

Paths: CPU -> `fused_moe_ref` (a loop over the experts that have tokens); CUDA -> token-expert
pairs grouped by expert, then grouped GEMMs without a Python loop over experts and without host
syncs (CUDA-graph capturable): `torch._grouped_mm` (CUTLASS) for large bf16 batches on sm90/sm100,
where it needs no device-to-host copy; our Triton grouped GEMM over expert-padded row blocks for
decode-sized batches (a handful of launches: what a CUDA-graph step pays per kernel) and elsewhere.
Both end in one fused combine: the weighted sum over each token's k experts, plus the shared
expert's gated output when the caller passes it. On the routed decode path a SwiGLU shared expert of
the routed experts' size is one more block of the Triton kernels (`SharedExpert`): its GEMMs and
activation launch nothing of their own.

A CUDA graph's step is padded to a captured size; `valid_tokens` (a device count, read by the kernels:
no host sync) marks the rows from it on as padding: they go to no expert (no expert weights loaded,
no rows computed for them) and come out zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hypic.kernels.activation import silu_and_mul
from hypic.kernels.triton_lazy import next_power_of_2, triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use

TRITON_MAX_PAIRS = 4096  # token-expert pairs up to which the Triton path beats CUTLASS's sort and launches
DECODE_MAX_PAIRS = 128  # pairs up to which a SwiGLU shared expert runs inside the routed kernels (decode steps)
# pairs up to which one program routes and lays out a batch: its pair-by-pair tiles grow as the square of the
# pairs, and on the H200 (Qwen3.5's 256 experts, top 8) it took 9.4 us at 4 tokens against 12.0 for the
# four launches, 61.5 against 13.2 at 10 tokens (scripts/tune_moe.py)
ROUTE_BLOCKS_MAX_PAIRS = 32
Shared = tuple[torch.Tensor, torch.Tensor]  # (shared expert output [N, H], its gate logit [N, 1])
Valid = torch.Tensor | None  # [1] int on the batch's device: rows from it on are padding; None: no padding
ACTIVATIONS = ("silu", "relu2")  # gated SwiGLU experts, ungated relu^2 experts


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, shared: Shared | None = None, activation: str = "silu",
              valid_tokens: Valid = None) -> torch.Tensor:
    """x: [N, H]; w_gate_up: [E, 2I, H] (gate rows, then up rows; relu2: [E, I, H], up rows only);
    w_down: [E, H, I]; topk_weights: [N, k] float; topk_ids: [N, k] int64. Returns [N, H] in x's
    dtype, plus sigmoid(gate logit) * shared output when `shared` is given; rows from
    `valid_tokens` on (padding) are zero."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe activation must be one of {ACTIVATIONS}, got {activation!r}")
    args = (x, w_gate_up, w_down, topk_weights, topk_ids)
    options = dict(shared=shared, activation=activation, valid_tokens=valid_tokens)
    if x.device.type != "cuda":
        return fused_moe_ref(*args, **options)
    if _cutlass_grouped_mm_applies(x, w_down) and topk_ids.numel() > TRITON_MAX_PAIRS:
        return moe_grouped_mm(*args, **options)
    return moe_triton(*args, **options)


@dataclass(frozen=True)
class SharedExpert:
    """A SwiGLU shared expert, gate_up [2I, H] (gate rows, then up rows) and down [H, I], and its gate
    logits [N, 1] (Qwen: the output is scaled by their sigmoid)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_logit: torch.Tensor

    def computed(self, x: torch.Tensor) -> Shared:
        """(its output [N, H], its gate logits), by torch's GEMMs: the paths that do not fuse it."""
        return F.linear(silu_and_mul(F.linear(x, self.gate_up)), self.down), self.gate_logit

    def fuses_with(self, w_down: torch.Tensor) -> bool:
        """Whether the routed kernels can run it as one more expert: the routed experts' size."""
        return self.down.shape == w_down.shape[1:]


@dataclass(frozen=True)
class Routing:
    """How a router's logits [N, E] become top-k weights and ids: softmax (Qwen, Granite), or with a
    score-correction `bias` DeepSeek-V3's sigmoid scores, group-limited choice and `scaling`
    (`route_grouped_sigmoid`: Nemotron 3, Kimi)."""

    top_k: int
    renormalize: bool
    bias: torch.Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [N, k] float32 and expert ids [N, k] int64 as `routing` says."""
    r = routing
    if r.bias is None:
        return route_topk(logits, r.top_k, r.renormalize)
    return route_grouped_sigmoid(logits, r.bias, r.top_k, r.n_group, r.topk_group, r.renormalize, r.scaling)


def routed_moe(x: torch.Tensor, logits: torch.Tensor, routing: Routing, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, *, shared_expert: SharedExpert | None = None, activation: str = "silu",
               valid_tokens: Valid = None) -> torch.Tensor:
    """`fused_moe` after `route(logits, routing)`, plus the gated shared expert when given. On CUDA a
    decode-sized batch (up to DECODE_MAX_PAIRS token-expert pairs) runs the Triton kernels with its shared
    expert (when it fuses) inside them, and up to ROUTE_BLOCKS_MAX_PAIRS (no group-limited choice) routes
    and lays out its expert blocks in one launch (`route_blocks_triton`) instead of five (softmax)."""
    pairs = logits.shape[0] * routing.top_k
    decode = x.device.type == "cuda" and pairs <= DECODE_MAX_PAIRS
    fused = decode and shared_expert is not None and shared_expert.fuses_with(w_down)
    shared = shared_expert.computed(x) if shared_expert is not None and not fused else None
    options = dict(shared=shared, activation=activation, valid_tokens=valid_tokens)
    if not decode:
        return fused_moe(x, w_gate_up, w_down, *route(logits, routing), **options)
    if pairs <= ROUTE_BLOCKS_MAX_PAIRS and routing.n_group == 1:
        block = _block_rows(pairs, w_down.shape[0], x.dtype)
        weights, ids, blocks = route_blocks_triton(logits, routing, block, valid_tokens)
    else:  # moe_triton lays out the blocks
        (weights, ids), blocks = route(logits, routing), None
    return moe_triton(x, w_gate_up, w_down, weights, ids, blocks=blocks,
                      shared_expert=shared_expert if fused else None, **options)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> softmax -> top-k: weights [N, k] float32 (renormalised to sum 1 when
    asked) and expert ids [N, k] int64. CUDA: one Triton program per few tokens."""
    if logits.device.type != "cuda":
        return route_topk_ref(logits, top_k, renormalize)
    return route_topk_triton(logits, top_k, renormalize)


def route_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    block_e = next_power_of_2(experts)
    block_rows = max(1, 2048 // block_e)
    _route_kernel[(-(-tokens // block_rows),)](
        logits, weights, ids, tokens, logits.stride(0), E=experts, K=top_k, BE=block_e,
        BK=next_power_of_2(top_k), BR=block_rows, RENORM=renormalize)
    return weights, ids


# ----------------------------------------------------------------------------- torch reference

def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, shared: Shared | None = None, activation: str = "silu",
                  valid_tokens: Valid = None) -> torch.Tensor:
    """Same contract as `fused_moe`, float32 math, one matmul pair per expert that has tokens."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids[:_num_valid(x.shape[0], valid_tokens)]
    for expert in ids.unique().tolist():
        token, which = (ids == expert).nonzero(as_tuple=True)
        h = x[token].float() @ w_gate_up[expert].float().T
        y = expert_activation(h, activation) @ w_down[expert].float().T
        out.index_add_(0, token, y * topk_weights[token, which, None].float())
    return _zero_padding(_add_shared(out.to(x.dtype), shared), valid_tokens)


def expert_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """[M, 2I] gate|up -> silu(gate) * up, or [M, I] up -> relu(up)^2 (in h's dtype)."""
    if activation == "relu2":
        return F.relu(h).square()
    return silu_and_mul(h)


def route_grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (Nemotron 3), float32: sigmoid scores; experts are chosen by score + bias
    within the topk_group groups whose two best biased scores sum highest; their unbiased scores
    are the weights, renormalised when asked, times `scaling`. Torch ops only (graph-capturable)."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=logits.device).scatter_(1, best_groups, True)
    choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _num_valid(rows: int, valid_tokens: Valid) -> int:
    """The rows before the padding (host sync: references only)."""
    return rows if valid_tokens is None else min(rows, int(valid_tokens))


def _zero_padding(out: torch.Tensor, valid_tokens: Valid) -> torch.Tensor:
    out[_num_valid(out.shape[0], valid_tokens):] = 0
    return out


def _add_shared(out: torch.Tensor, shared: Shared | None) -> torch.Tensor:
    if shared is None:
        return out
    shared_out, gate_logit = shared
    return out + torch.sigmoid(gate_logit) * shared_out.to(out.dtype)  # float32 when the expert kernels made it


# ----------------------------------------------------------------------------- GPU: shared

def _sort_by_expert(topk_ids: torch.Tensor, num_experts: int, valid_tokens: Valid
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): pair indices (token * k + slot) grouped by expert, and pairs per expert
    [E]. Padding rows' pairs go to a sentinel expert E, so they sort last and no count has them."""
    flat = topk_ids.flatten()
    if valid_tokens is not None:
        pair = torch.arange(flat.shape[0], device=flat.device)
        flat = torch.where(pair < valid_tokens * topk_ids.shape[1], flat, num_experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    return order, counts[:num_experts]


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, row_of_pair: torch.Tensor | None,
                dtype: torch.dtype, shared: Shared | None, valid_tokens: Valid = None) -> torch.Tensor:
    """Expert outputs y (pair p = token * k + slot in row row_of_pair[p], or row p when None) ->
    [N, H]: each token's k outputs weighted in float32, rounded to dtype, plus the gated shared
    expert (rounded as torch's bf16 ops round); padding rows zero, their y rows unread. CUDA: one
    Triton pass, no [N, k, H] float32 copy."""
    if y.device.type != "cuda":
        pair_out = y if row_of_pair is None else y[row_of_pair]
        per_token = pair_out.view(*topk_weights.shape, -1).float()
        out = _add_shared((per_token * topk_weights[..., None].float()).sum(1).to(dtype), shared)
        return _zero_padding(out, valid_tokens)
    return moe_combine_triton(y, topk_weights, row_of_pair, dtype, shared, valid_tokens)


def moe_combine_triton(y: torch.Tensor, topk_weights: torch.Tensor, row_of_pair: torch.Tensor | None,
                       dtype: torch.dtype, shared: Shared | None, valid_tokens: Valid = None) -> torch.Tensor:
    tokens, top_k = topk_weights.shape
    hidden = y.shape[1]
    out = torch.empty((tokens, hidden), dtype=dtype, device=y.device)
    shared_out, gate_logit = shared if shared is not None else (None, None)
    block_h = min(1024, next_power_of_2(hidden))
    _combine_kernel[(tokens, -(-hidden // block_h))](
        y, topk_weights.contiguous(), row_of_pair, shared_out, gate_logit, out, valid_tokens, y.stride(0),
        shared_out.stride(0) if shared is not None else 0, gate_logit.stride(0) if shared is not None else 0,
        H=hidden, K=top_k, BH=block_h, HAS_INDEX=row_of_pair is not None, HAS_SHARED=shared is not None,
        HAS_VALID=valid_tokens is not None)
    return out


# ----------------------------------------------------------------------------- GPU: CUTLASS

def _cutlass_grouped_mm_applies(x: torch.Tensor, w_down: torch.Tensor) -> bool:
    """bf16 on sm90/sm100 runs CUTLASS; other cases fall back to a loop that syncs on offsets.
    Its TMA loads want 16-byte aligned rows."""
    aligned = x.shape[1] % 8 == 0 and w_down.shape[2] % 8 == 0
    major = torch.cuda.get_device_capability(x.device)[0]
    return x.dtype == torch.bfloat16 and major in (9, 10) and aligned and hasattr(torch, "_grouped_mm")


def moe_grouped_mm(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, shared: Shared | None = None, activation: str = "silu",
                   valid_tokens: Valid = None) -> torch.Tensor:
    order, counts = _sort_by_expert(topk_ids, w_gate_up.shape[0], valid_tokens)
    offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert's group (padding pairs: past the last)
    rows = x[order // topk_ids.shape[1]]
    h = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets)
    y_sorted = torch._grouped_mm(expert_activation(h, activation), w_down.transpose(1, 2), offs=offsets)
    row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return moe_combine(y_sorted, topk_weights, row_of_pair, x.dtype, shared, valid_tokens)


# ----------------------------------------------------------------------------- GPU: Triton

@dataclass(frozen=True)
class ExpertBlocks:
    """Pairs sorted by expert, each expert's run padded to a multiple of `block` rows; the pairs of
    padding tokens (from valid_tokens on) are in none.

    Invariant: rows[i] is a pair index, or num_pairs for padding; block j serves
    expert block_expert[j] (num_experts past the last used block). The block count is an upper
    bound fixed by shapes alone: sum_e ceil(c_e / block) <= pairs // block + min(E, pairs)."""

    rows: torch.Tensor  # [num_blocks * block] int64
    block_expert: torch.Tensor  # [num_blocks] int64
    block: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]

    @staticmethod
    def bound(pairs: int, num_experts: int, block: int) -> int:
        """The block count of the invariant's bound: what every layout of `pairs` allocates."""
        return pairs // block + min(num_experts, pairs)


def expert_blocks(topk_ids: torch.Tensor, num_experts: int, block: int, valid_tokens: Valid = None) -> ExpertBlocks:
    """The blocks of a batch; CUDA: four launches (counting by atomics, one scan, one scatter), and a
    pair's place inside its expert's run is the order its atomic landed in: any order is valid."""
    if topk_ids.device.type == "cuda":
        return expert_blocks_triton(topk_ids, num_experts, block, valid_tokens)
    return expert_blocks_ref(topk_ids, num_experts, block, valid_tokens)


def expert_blocks_ref(topk_ids: torch.Tensor, num_experts: int, block: int, valid_tokens: Valid = None
                      ) -> ExpertBlocks:
    order, counts = _sort_by_expert(topk_ids, num_experts, valid_tokens)
    pairs = order.shape[0]
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = order[: int(counts.sum())]  # padding tokens' pairs sort last
    expert = topk_ids.flatten()[order]
    rank = torch.arange(order.shape[0], device=order.device) - (counts.cumsum(0) - counts)[expert]
    num_blocks = ExpertBlocks.bound(pairs, num_experts, block)
    rows = torch.full((num_blocks * block,), pairs, dtype=torch.long, device=order.device)
    rows.index_copy_(0, padded_start[expert] + rank, order)
    starts = torch.arange(num_blocks, device=order.device) * block
    return ExpertBlocks(rows, torch.searchsorted(padded_end, starts, right=True), block)


def expert_blocks_triton(topk_ids: torch.Tensor, num_experts: int, block: int, valid_tokens: Valid = None
                         ) -> ExpertBlocks:
    pairs, device = topk_ids.numel(), topk_ids.device
    num_blocks = ExpertBlocks.bound(pairs, num_experts, block)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(pairs, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    rows = torch.empty(num_blocks * block, dtype=torch.long, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.long, device=device)
    ids = topk_ids.contiguous()
    grid = (-(-pairs // 1024),)
    real = dict(TOPK=topk_ids.shape[1], HAS_VALID=valid_tokens is not None, BP=1024)  # which pairs count
    _count_kernel[grid](ids, counts, rank, pairs, valid_tokens, **real)
    _layout_kernel[(1,)](counts, starts, block_expert, rows, pairs, num_blocks, E=num_experts,
                         BE=next_power_of_2(num_experts), BLOCK=block, BJ=32, BP=1024)
    _place_kernel[grid](ids, rank, starts, rows, pairs, valid_tokens, **real)
    return ExpertBlocks(rows, block_expert, block)


def route_blocks_triton(logits: torch.Tensor, routing: Routing, block: int, valid_tokens: Valid = None
                        ) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """`route` (without group-limited choice) and `expert_blocks_ref`'s layout of its ids (pairs in order
    within each expert; padding tokens' in none) in one program, for up to ROUTE_BLOCKS_MAX_PAIRS pairs:
    no atomics, so the layout is the reference's."""
    tokens, experts = logits.shape
    pairs, top_k = tokens * routing.top_k, routing.top_k
    num_blocks = ExpertBlocks.bound(pairs, experts, block)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    rows = torch.empty(num_blocks * block, dtype=torch.long, device=logits.device)
    block_expert = torch.empty(num_blocks, dtype=torch.long, device=logits.device)
    tile = next_power_of_2(tokens) * next_power_of_2(top_k)  # the pair-by-pair tiles are tile x tile
    _route_blocks_kernel[(1,)](
        logits, routing.bias, weights, ids, rows, block_expert, tokens, logits.stride(0), num_blocks,
        routing.scaling, valid_tokens, E=experts, K=top_k, BE=next_power_of_2(experts), BT=next_power_of_2(tokens),
        BK=next_power_of_2(top_k), BLOCK=block, BJ=32, BRW=64, RENORM=routing.renormalize,
        SIGMOID=routing.bias is not None, HAS_VALID=valid_tokens is not None,
        num_warps=8 if tile >= 128 else 4)  # 128 x 128 spills at 4 warps (sm90)
    return weights, ids, ExpertBlocks(rows, block_expert, block)


@dataclass(frozen=True)
class Tile:
    """How one expert GEMM launches: output columns a program computes, its reduction step, warps, and
    the loads in flight (software-pipeline stages)."""

    n: int
    k: int
    warps: int
    stages: int


@dataclass(frozen=True)
class MoeTiles:
    gate_up: Tile
    down: Tile


def moe_tiles(pairs: int, block: int) -> MoeTiles:
    """The tiles `moe_triton` launches for `pairs` token-expert pairs in blocks of `block` rows. Blocks of
    16 rows (up to ~512 tokens of 256 experts) reduce 128 columns a step, gate/up four loads deep: on the
    H200 (scripts/tune_moe.py, Qwen3.5's experts) that gate/up tile cut the whole call at one token from
    27.2 to 22.9 us, and the best tiles of its grid at 2 to 128 tokens all reduce 128 columns a step."""
    n = 32 if pairs <= 64 else 64  # a few pairs: narrower tiles, more programs streaming weights
    if block == 16:
        return MoeTiles(Tile(64, 128, 4, 4), Tile(n, 128, 4, 3))
    # blocks of 32+ rows in 8 warps: in 4, 32 rows spill the gated kernel's tiles (ptxas, sm90)
    return MoeTiles(Tile(n, 64, 8, 3), Tile(n, 64, 8, 3))


def moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, *, shared: Shared | None = None, activation: str = "silu",
               valid_tokens: Valid = None, blocks: ExpertBlocks | None = None,
               shared_expert: SharedExpert | None = None, tiles: MoeTiles | None = None) -> torch.Tensor:
    """The Triton path; `blocks` is the pairs' layout when the router made it already. A `shared_expert`
    (instead of `shared`; one that `fuses_with` w_down) is computed by extra blocks after the routed
    ones, each token's row after the pairs' rows (its padding tokens' rows computed, never read).
    `tiles`: other launch tiles than `moe_tiles`' (scripts/tune_moe.py)."""
    num_experts, inter, hidden = w_down.shape[0], w_down.shape[2], x.shape[1]
    tokens, pairs = x.shape[0], topk_ids.numel()
    if blocks is None:
        blocks = expert_blocks(topk_ids, num_experts, _block_rows(pairs, num_experts, x.dtype), valid_tokens)
    tiles = tiles or moe_tiles(pairs, blocks.block)
    common = dict(TOPK=topk_ids.shape[1], NUM_EXPERTS=num_experts, I=inter, H=hidden, BM=blocks.block,
                  DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    s_gate_up, s_down = (shared_expert.gate_up, shared_expert.down) if shared_expert else (w_gate_up[0], w_down[0])
    rows = pairs + (tokens if shared_expert else 0)
    grid_m = blocks.num_blocks + (-(-tokens // blocks.block) if shared_expert else 0)
    layout = (blocks.rows, blocks.block_expert, blocks.num_blocks, pairs, tokens)
    act = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    up = tiles.gate_up
    _moe_gate_up_kernel[(grid_m, -(-inter // up.n))](
        x, w_gate_up, s_gate_up, *layout, act, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        s_gate_up.stride(0), act.stride(0), GATED=activation == "silu", BN=up.n, BK=up.k, num_warps=up.warps,
        num_stages=up.stages, **common)
    pair_out = torch.empty((rows, hidden), dtype=torch.float32, device=x.device)
    down = tiles.down
    _moe_down_kernel[(grid_m, -(-hidden // down.n))](
        act, w_down, s_down, *layout, pair_out, act.stride(0), w_down.stride(0), w_down.stride(1),
        s_down.stride(0), pair_out.stride(0), BN=down.n, BK=down.k, num_warps=down.warps, num_stages=down.stages,
        **common)
    if shared_expert is not None:  # its float32 rows rounded in the combine, as torch's bf16 GEMM rounds
        shared = (pair_out[pairs:], shared_expert.gate_logit)
    return moe_combine(pair_out[:pairs], topk_weights, None, x.dtype, shared, valid_tokens)


def _block_rows(pairs: int, num_experts: int, dtype: torch.dtype) -> int:
    """Rows of an expert block: the power of two above the rows an expert averages, 16 to 64. Each
    block streams its expert's weights, so an expert should mostly fit one (Nemotron 3 Nano, 2304
    pairs over 128 experts: 32, not two blocks of 16); float32 always 16 (its wider tiles spill)."""
    if dtype == torch.float32:
        return 16
    return min(64, max(16, next_power_of_2(pairs // num_experts + 1)))


@triton_kernel
def _block_rows_of(rows, block_expert, i_m, num_blocks, num_pairs, tokens, TOPK: tl.constexpr, BM: tl.constexpr):
    """Block i_m's (routed, expert, row, token, mask): a routed block's rows are pairs (row = pair index),
    a shared block's (from num_blocks on) are tokens, at row num_pairs + token. An unused routed block
    has expert NUM_EXPERTS."""
    routed = i_m < num_blocks
    last = tl.minimum(i_m, num_blocks - 1)  # a shared block reads the last routed one's entries, unused
    expert = tl.load(block_expert + last)
    local = (i_m - num_blocks) * BM + tl.arange(0, BM)
    pair = tl.load(rows + last * BM + tl.arange(0, BM))
    row = tl.where(routed, pair, num_pairs + local)
    token = tl.where(routed, pair // TOPK, local)
    m_row = tl.where(routed, pair < num_pairs, local < tokens)
    return routed, expert, row, token, m_row


# a step's block, pair and token counts
@triton_kernel(do_not_specialize=("num_blocks", "num_pairs", "tokens"))
def _moe_gate_up_kernel(x, w, w_shared, rows, block_expert, num_blocks, num_pairs, tokens, act, stride_x,
                        stride_we, stride_wn, stride_sn, stride_a, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                        I: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, GATED: tl.constexpr):
    """act[row, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, I + n]) for one block of rows (w_shared's
    rows for a shared block); ungated (relu2): act[row, n] = relu(x[token] . w[e, n])^2."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    routed, expert, pair, token, m_row = _block_rows_of(rows, block_expert, i_m, num_blocks, num_pairs, tokens,
                                                        TOPK, BM)
    if routed & (expert >= NUM_EXPERTS):
        return
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    p_w = (tl.where(routed, w + expert * stride_we, w_shared)
           + o_n[None, :] * tl.where(routed, stride_wn, stride_sn))
    acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < H
        b_x = tl.load(x + token[:, None] * stride_x + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
        b_up = tl.load(p_w + (I * tl.where(routed, stride_wn, stride_sn) if GATED else 0) + o_k[:, None],
                       mask=m_w, other=0.0)
        acc_up = tl.dot(b_x, b_up, acc_up, input_precision=DOT_PRECISION)
        if GATED:
            b_gate = tl.load(p_w + o_k[:, None], mask=m_w, other=0.0)
            acc_gate = tl.dot(b_x, b_gate, acc_gate, input_precision=DOT_PRECISION)
    if GATED:
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:
        h = tl.maximum(acc_up, 0.0)
        h = h * h
    tl.store(act + pair[:, None] * stride_a + o_n[None, :], h.to(act.dtype.element_ty),
             mask=m_row[:, None] & m_n[None, :])


@triton_kernel(do_not_specialize=("num_blocks", "num_pairs", "tokens"))
def _moe_down_kernel(act, w, w_shared, rows, block_expert, num_blocks, num_pairs, tokens, out, stride_a,
                     stride_we, stride_wn, stride_sn, stride_o, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                     I: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """out[row, n] = act[row] . w[e, n] (float32) for one block of rows (w_shared for a shared block)."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    routed, expert, pair, _, m_row = _block_rows_of(rows, block_expert, i_m, num_blocks, num_pairs, tokens,
                                                    TOPK, BM)
    if routed & (expert >= NUM_EXPERTS):
        return
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    p_w = (tl.where(routed, w + expert * stride_we, w_shared)
           + o_n[None, :] * tl.where(routed, stride_wn, stride_sn))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < I
        b_a = tl.load(act + pair[:, None] * stride_a + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc = tl.dot(b_a, b_w, acc, input_precision=DOT_PRECISION)
    tl.store(out + pair[:, None] * stride_o + o_n[None, :], acc, mask=m_row[:, None] & m_n[None, :])


@triton_kernel
def _real_pairs(i, num_pairs, valid_tokens, TOPK: tl.constexpr, HAS_VALID: tl.constexpr):
    """Which of the pairs i exist and belong to a real token (every pair without valid_tokens)."""
    m = i < num_pairs
    if HAS_VALID:
        m = m & (i < tl.load(valid_tokens).to(tl.int32) * TOPK)
    return m


@triton_kernel(do_not_specialize=("num_pairs",))
def _count_kernel(ids, counts, rank, num_pairs, valid_tokens, TOPK: tl.constexpr, HAS_VALID: tl.constexpr,
                  BP: tl.constexpr):
    """counts[e] += 1 per real pair of expert e; the value it found is the pair's rank within e."""
    i = tl.program_id(0) * BP + tl.arange(0, BP)
    m = _real_pairs(i, num_pairs, valid_tokens, TOPK, HAS_VALID)
    expert = tl.load(ids + i, mask=m, other=0)
    tl.store(rank + i, tl.atomic_add(counts + expert, 1, mask=m), mask=m)


@triton_kernel(do_not_specialize=("num_pairs", "num_blocks"))
def _layout_kernel(counts, starts, block_expert, rows, num_pairs, num_blocks, E: tl.constexpr,
                   BE: tl.constexpr, BLOCK: tl.constexpr, BJ: tl.constexpr, BP: tl.constexpr):
    """One program: each expert's first padded row, each block's expert (E past the used blocks),
    and every row set to padding (num_pairs) before _place_kernel fills the real ones."""
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    padded = (tl.load(counts + o_e, mask=m_e, other=0) + BLOCK - 1) // BLOCK * BLOCK
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts + o_e, ends - padded, mask=m_e)
    for j0 in range(0, num_blocks, BJ):
        j = j0 + tl.arange(0, BJ)
        passed = (ends[None, :] <= (j * BLOCK)[:, None]) & m_e[None, :]  # experts ending before block j
        tl.store(block_expert + j, tl.sum(passed.to(tl.int32), axis=1).to(tl.int64), mask=j < num_blocks)
    for r0 in range(0, num_blocks * BLOCK, BP):
        r = r0 + tl.arange(0, BP)
        tl.store(rows + r, tl.full((BP,), 0, tl.int64) + num_pairs, mask=r < num_blocks * BLOCK)


@triton_kernel(do_not_specialize=("num_pairs",))
def _place_kernel(ids, rank, starts, rows, num_pairs, valid_tokens, TOPK: tl.constexpr, HAS_VALID: tl.constexpr,
                  BP: tl.constexpr):
    i = tl.program_id(0) * BP + tl.arange(0, BP)
    m = _real_pairs(i, num_pairs, valid_tokens, TOPK, HAS_VALID)
    expert = tl.load(ids + i, mask=m, other=0)
    row = tl.load(starts + expert, mask=m, other=0) + tl.load(rank + i, mask=m, other=0)
    tl.store(rows + row, i.to(tl.int64), mask=m)


@triton_kernel
def _combine_kernel(y, weights, row_of_pair, shared, gate_logit, out, valid_tokens, stride_y, stride_s, stride_g,
                    H: tl.constexpr, K: tl.constexpr, BH: tl.constexpr, HAS_INDEX: tl.constexpr,
                    HAS_SHARED: tl.constexpr, HAS_VALID: tl.constexpr):
    """A padding token (from valid_tokens on) reads nothing (its pairs have no output) and stores 0."""
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    m_out = o_h < H
    m_h = m_out
    if HAS_VALID:  # compared as a vector: Triton's interpreter takes no 0-d mask
        m_h = m_h & (tl.zeros((BH,), dtype=tl.int64) + t < tl.load(valid_tokens))
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = t * K + j
        if HAS_INDEX:
            row = tl.load(row_of_pair + row)
        b_y = tl.load(y + row * stride_y + o_h, mask=m_h, other=0.0).to(tl.float32)
        acc += tl.load(weights + t * K + j).to(tl.float32) * b_y
    total = acc.to(out.dtype.element_ty)
    if HAS_SHARED:  # round where torch's bf16 ops round: sigmoid, product, sum
        gate = tl.sigmoid(tl.load(gate_logit + t * stride_g).to(tl.float32)).to(out.dtype.element_ty)
        b_s = tl.load(shared + t * stride_s + o_h, mask=m_h, other=0.0).to(out.dtype.element_ty)
        product = (gate.to(tl.float32) * b_s.to(tl.float32)).to(out.dtype.element_ty)
        total = (total.to(tl.float32) + product.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + t * H + o_h, total, mask=m_out)


@triton_kernel(do_not_specialize=("tokens",))
def _route_kernel(logits, weights, ids, tokens, stride_l, E: tl.constexpr, K: tl.constexpr, BE: tl.constexpr,
                  BK: tl.constexpr, BR: tl.constexpr, RENORM: tl.constexpr):
    t = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    _top_k(logits, logits, weights, ids, t, tokens, stride_l, 1.0, E, K, BE, BK, RENORM, False)


@triton_kernel
def _top_k(logits, bias, weights, ids, t, tokens, stride_l, scaling, E: tl.constexpr, K: tl.constexpr,
           BE: tl.constexpr, BK: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr):
    """Rows t: softmax over E, K rounds of (argmax, its value, knock out), renormalised; or (SIGMOID)
    sigmoid scores, the K best of score + bias, their scores renormalised as route_grouped_sigmoid does,
    times scaling. Stores them and returns the ids [rows, BK] (int32)."""
    o_e, o_k = tl.arange(0, BE), tl.arange(0, BK)
    m_t, m_e = t < tokens, o_e < E
    x = tl.load(logits + (t * stride_l)[:, None] + o_e[None, :], mask=m_t[:, None] & m_e[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(m_e[None, :], x, float("-inf"))  # rows past the end stay finite: no NaN anywhere
    if SIGMOID:
        score = tl.sigmoid(x)
        choice = score + tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(m_e[None, :], choice, float("-inf"))
    else:
        score = tl.exp(x - tl.max(x, axis=1)[:, None])
        score = score / tl.sum(score, axis=1)[:, None]
        choice = score
    picked_w = tl.zeros((t.shape[0], BK), dtype=tl.float32)
    picked_id = tl.zeros((t.shape[0], BK), dtype=tl.int32)
    for j in tl.static_range(K):
        best_id = tl.argmax(choice, axis=1)
        hit = o_e[None, :] == best_id[:, None]
        best = tl.sum(tl.where(hit, score, 0.0), axis=1)
        picked_w = tl.where(o_k[None, :] == j, best[:, None], picked_w)
        picked_id = tl.where(o_k[None, :] == j, best_id[:, None], picked_id)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        total = tl.sum(picked_w, axis=1)
        if SIGMOID:
            total = total + 1e-20
        picked_w = picked_w / total[:, None]
    if SIGMOID:
        picked_w = picked_w * scaling
    dense = (t * K)[:, None] + o_k[None, :]
    m = m_t[:, None] & (o_k < K)[None, :]
    tl.store(weights + dense, picked_w, mask=m)
    tl.store(ids + dense, picked_id.to(tl.int64), mask=m)
    return picked_id


@triton_kernel(do_not_specialize=("tokens", "num_blocks"))
def _route_blocks_kernel(logits, bias, weights, ids, rows, block_expert, tokens, stride_l, num_blocks, scaling,
                         valid_tokens, E: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BLOCK: tl.constexpr, BJ: tl.constexpr, BRW: tl.constexpr,
                         RENORM: tl.constexpr, SIGMOID: tl.constexpr, HAS_VALID: tl.constexpr):
    """One program: every token's top-k, then the layout from pair-by-pair comparisons (pair p = t * K + j):
    its expert's pair count and its rank among them, its expert's first padded row (the padded runs
    of the experts of lower id), each block's expert and each row's pair."""
    t = tl.arange(0, BT).to(tl.int64)
    picked = _top_k(logits, bias, weights, ids, t, tokens, stride_l, scaling, E, K, BE, BK, RENORM, SIGMOID)
    o_k = tl.arange(0, BK)
    pair = tl.reshape(t[:, None].to(tl.int32) * K + o_k[None, :], (BT * BK,))
    real = t < tokens
    if HAS_VALID:  # a captured step's padding tokens: their pairs go to no expert
        real = real & (t < tl.load(valid_tokens))
    valid = tl.reshape((real[:, None] & (o_k < K)[None, :]).to(tl.int32), (BT * BK,)) != 0
    expert = tl.reshape(picked, (BT * BK,))
    same = (expert[:, None] == expert[None, :]) & valid[:, None] & valid[None, :]  # [p, q]
    count = tl.sum(same.to(tl.int32), axis=1)
    rank = tl.sum((same & (pair[None, :] < pair[:, None])).to(tl.int32), axis=1)
    first = valid & (rank == 0)  # one pair stands for each expert in use
    padded = (count + BLOCK - 1) // BLOCK * BLOCK
    lower = first[None, :] & (expert[None, :] < expert[:, None])
    start = tl.sum(tl.where(lower, padded[None, :], 0), axis=1)
    for j0 in range(0, num_blocks, BJ):
        j = j0 + tl.arange(0, BJ)
        row0 = (j * BLOCK)[:, None]
        covers = first[None, :] & (start[None, :] <= row0) & (row0 < (start + padded)[None, :])  # [j, q]
        owner = tl.sum(tl.where(covers, expert[None, :], 0), axis=1)
        used = tl.sum(covers.to(tl.int32), axis=1) > 0
        tl.store(block_expert + j, tl.where(used, owner, E).to(tl.int64), mask=j < num_blocks)
    num_pairs = tokens * K
    for r0 in range(0, num_blocks * BLOCK, BRW):
        r = r0 + tl.arange(0, BRW)
        hit = valid[None, :] & ((start + rank)[None, :] == r[:, None])  # [r, p]
        filled = tl.sum(hit.to(tl.int32), axis=1) > 0
        at = tl.sum(tl.where(hit, pair[None, :], 0), axis=1)
        tl.store(rows + r, tl.where(filled, at, num_pairs).to(tl.int64), mask=r < num_blocks * BLOCK)
