"""Times the PIC walk kernel over its launch shapes at Qwen3.5 GDN heads, against the float64 reference.

One request walks N recompute tokens with P cached pieces spread evenly among them, as a PIC
prefill does at each linear layer (float32 state pool, tuples stored as the segment store stores them
at --tuple-dtype, bf16 q/k/v, checkpoints passed as the engine passes them). For each family, launch
shape (BV value columns and num_warps warps a program) and walk: the median time of a call
(triton.testing.do_bench, L2 flushed before each call), per call and per token, and the largest
absolute errors of the outputs and of the end state against `compose_and_recur_ref` in float64. A
shape that fails to compile or run is reported and skipped; shapes not started within --budget-s are
listed as skipped. Prints a table, writes JSON.

    python scripts/bench_compose.py
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hypic.config import SEGMENT_STATE_DTYPES
from hypic.kernels.compose import (CachedPieces, StateCheckpoints, WalkConfig, compose_and_recur_ref,
                                   compose_and_recur_triton, walk_config)
from hypic.kernels.linear_families import LinearFamily, get_family
from results import device_label, result_path, run_record

KEY_HEADS, VALUE_HEADS, DIM = 16, 32, 128  # Qwen3.5 Gated DeltaNet layers
DEVICE = "cuda"
TOKENS_PER_PIECE = 8  # token factors multiplied into each cached T (a short segment)


@dataclass(frozen=True)
class Walk:
    """One request's walk on cuda: its inputs, initial pool and float64 reference results."""

    family: LinearFamily
    tokens: int
    pieces: int
    inputs: tuple  # q, k, v, g, beta
    table: tuple  # slots, has_state, cu_seqlens, pieces, t_src, s0_src
    kwargs: dict
    initial: torch.Tensor  # [2, HV, K, V] float32 pool: slot 0 the request's initial state
    expected_o: torch.Tensor
    expected_state: torch.Tensor

    def run(self, pool: torch.Tensor, config: WalkConfig) -> torch.Tensor:
        return compose_and_recur_triton(*self.inputs, pool, *self.table, **self.kwargs, config=config)


@dataclass(frozen=True)
class Result:
    family: str
    tokens: int
    pieces: int
    block_v: int
    num_warps: int
    us_per_call: float | None = None
    us_per_token: float | None = None
    max_abs_err_o: float | None = None  # bf16 outputs against float64 math (rounded to float32)
    max_abs_err_state: float | None = None  # float32 end state against float64
    first_call_s: float | None = None  # the shape's compile on the first walk, a plain run on the others
    error: str | None = None


def make_walk(family: LinearFamily, tokens: int, pieces: int, gen: torch.Generator, tuple_dtype: torch.dtype) -> Walk:
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=DEVICE)  # noqa: E731
    gate_shape = (tokens, VALUE_HEADS, DIM) if family.gate_per_key else (tokens, VALUE_HEADS)
    q = F.normalize(randn(tokens, KEY_HEADS, DIM), dim=-1).bfloat16()
    k = F.normalize(randn(tokens, KEY_HEADS, DIM), dim=-1).bfloat16()
    v = randn(tokens, VALUE_HEADS, DIM).bfloat16()
    g = F.logsigmoid(randn(*gate_shape) + 3.0)
    beta = torch.sigmoid(randn(tokens, VALUE_HEADS)).bfloat16() if family.kind == "dense" else None
    T, S0 = random_tuples(family, pieces, gen)
    T, S0 = T.to(family.t_storage_dtype(tuple_dtype)), S0.to(tuple_dtype)
    pieces_table = CachedPieces.build([[(p * tokens // pieces, p * T[0].numel(), p * S0[0].numel())
                                        for p in range(pieces)]], DEVICE)
    initial = torch.stack([randn(VALUE_HEADS, DIM, DIM) * 0.1, torch.zeros(VALUE_HEADS, DIM, DIM, device=DEVICE)])
    slots = torch.tensor([0], device=DEVICE)
    table = (slots, torch.tensor([True], device=DEVICE), torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE),
             pieces_table, T.flatten(), S0.flatten())
    kwargs = dict(family=family, scale=DIM ** -0.5,
                  checkpoints=StateCheckpoints(torch.tensor([-1], device=DEVICE), slots))  # none, as most steps
    ref_pool = initial.double()
    # float32 values: the reference rounds its outputs to v's dtype, and bf16 would hide the kernel's error
    expected_o = compose_and_recur_ref(q, k, v.float(), g, beta, ref_pool, *table, **kwargs)
    return Walk(family, tokens, pieces, (q, k, v, g, beta), table, kwargs, initial, expected_o, ref_pool[0])


def random_tuples(family: LinearFamily, pieces: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [P, HV, *t_shape], S0 [P, HV, K, V]), float32: T multiplied out of TOKENS_PER_PIECE token
    factors, so that it has a real segment's structure (near-unit norm, decayed)."""
    T = family.identity_T(pieces * VALUE_HEADS, DIM, torch.float32, DEVICE)
    rows = pieces * VALUE_HEADS
    for _ in range(TOKENS_PER_PIECE):
        k = F.normalize(torch.randn(rows, DIM, generator=gen, device=DEVICE), dim=-1)
        gate_shape = (rows, DIM) if family.gate_per_key else (rows,)
        g = F.logsigmoid(torch.randn(*gate_shape, generator=gen, device=DEVICE) + 3.0)
        beta = torch.sigmoid(torch.randn(rows, generator=gen, device=DEVICE))
        T = family.combine_T(family.token_T(k, g, beta), T)
    S0 = torch.randn(pieces, VALUE_HEADS, DIM, DIM, generator=gen, device=DEVICE) * 0.3
    return T.view(pieces, VALUE_HEADS, *T.shape[1:]).contiguous(), S0


def measure(walk: Walk, config: WalkConfig, rep_ms: int) -> Result:
    """Check one call against the reference, then time calls (on another pool, which walks on)."""
    from triton.testing import do_bench

    pool = walk.initial.clone()
    started = time.perf_counter()
    o = walk.run(pool, config)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - started
    err_o = (o.float() - walk.expected_o.float()).abs().max().item()
    err_state = (pool[0].double() - walk.expected_state).abs().max().item()
    ms = do_bench(lambda: walk.run(pool, config), warmup=max(1, rep_ms // 4), rep=rep_ms, return_mode="median")
    return Result(walk.family.name, walk.tokens, walk.pieces, config.block_v, config.num_warps, us_per_call=ms * 1e3,
                  us_per_token=ms * 1e3 / walk.tokens, max_abs_err_o=err_o, max_abs_err_state=err_state,
                  first_call_s=first_call_s)


def sweep_configs(family: LinearFamily, block_vs: list[int], warps: list[int]) -> list[WalkConfig]:
    """The engine's shape first (measured whatever the budget), then the rest of the grid."""
    default = walk_config(family, DIM)
    grid = [WalkConfig(bv, nw) for bv, nw in itertools.product(block_vs, warps)]
    return [default] + [c for c in grid if c != default]


def run_shape(walks: list[Walk], config: WalkConfig, rep_ms: int) -> list[Result]:
    """Every walk of one family at one launch shape; a failure ends this shape only."""
    results = []
    for walk in walks:
        try:
            results.append(measure(walk, config, rep_ms))
        except Exception as e:  # a shape that does not compile or run must not hide the others
            lines = str(e).strip().splitlines() or [""]
            error = f"{type(e).__name__}: {lines[-1]}"[:300]
            return results + [Result(walk.family.name, walk.tokens, walk.pieces, config.block_v, config.num_warps,
                                     error=error)]
    return results


def print_result(r: Result) -> None:
    shape = f"{r.family:9} {f'{r.tokens}x{r.pieces}':>8} {f'BV={r.block_v} warps={r.num_warps}':16}"
    if r.error is not None:
        print(f"{shape}  FAILED {r.error}", flush=True)
        return
    print(f"{shape} {r.us_per_call:9.1f} {r.us_per_token:8.2f} {r.max_abs_err_o:9.2e} {r.max_abs_err_state:9.2e}"
          f" {r.first_call_s:8.2f}", flush=True)


def write_report(out: Path, results: list[Result], skipped: list[str], defaults: dict[str, dict],
                 tuple_dtype: str) -> None:
    best: dict[str, dict] = {}
    for r in results:
        key = f"{r.family} {r.tokens}x{r.pieces}"
        if r.error is None and (key not in best or r.us_per_call < best[key]["us_per_call"]):
            best[key] = dict(block_v=r.block_v, num_warps=r.num_warps, us_per_call=r.us_per_call)
    import triton
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  **run_record(),
                  heads=dict(key_heads=KEY_HEADS, value_heads=VALUE_HEADS, key_dim=DIM, value_dim=DIM),
                  tuple_dtype=tuple_dtype,
                  engine_default=defaults, best=best, results=[asdict(r) for r in results], skipped=skipped)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="default: bench/results/compose_<device>_qwen3_5_moe_<tuple dtype>.json")
    parser.add_argument("--families", default="gdn,diagonal")
    parser.add_argument("--walks", default="64x4,64x16,256x4,256x16", help="tokens x pieces, comma-separated")
    parser.add_argument("--block-v", type=int_list, default=[8, 16, 32])
    parser.add_argument("--num-warps", type=int_list, default=[1, 2, 4, 8])
    parser.add_argument("--rep-ms", type=int, default=20, help="do_bench time per measurement")
    parser.add_argument("--tuple-dtype", choices=SEGMENT_STATE_DTYPES, default="float32",
                        help="storage of cached T and S0 (EngineConfig.segment_state_dtype)")
    parser.add_argument("--budget-s", type=float, default=40.0,
                        help="shared equally by the families: no new shape starts past a family's share")
    args = parser.parse_args()
    args.out = args.out or result_path(
        "compose", device_label(torch.cuda.get_device_name()), f"qwen3_5_moe_{args.tuple_dtype}")
    started, gen = time.perf_counter(), torch.Generator(DEVICE).manual_seed(0)
    families = [get_family(name) for name in args.families.split(",")]
    results: list[Result] = []
    skipped: list[str] = []
    defaults = {family.name: asdict(walk_config(family, DIM)) for family in families}
    print(f"{'family':9} {'walk':>8} {'shape':16} {'us/call':>9} {'us/tok':>8} {'err o':>9} {'err S':>9}"
          f" {'first s':>8}")
    for i, family in enumerate(families):
        deadline = started + args.budget_s * (i + 1) / len(families)
        walks = [make_walk(family, *int_list(w.replace("x", ",")), gen, getattr(torch, args.tuple_dtype))
                 for w in args.walks.split(",")]
        for n, config in enumerate(sweep_configs(family, args.block_v, args.num_warps)):
            if n > 0 and time.perf_counter() > deadline:
                skipped.append(f"{family.name} BV={config.block_v} warps={config.num_warps}")
                continue
            for result in run_shape(walks, config, args.rep_ms):
                print_result(result)
                results.append(result)
            write_report(args.out, results, skipped, defaults, args.tuple_dtype)  # a killed run keeps what it measured
    if skipped:
        print(f"skipped (past --budget-s {args.budget_s:.0f}): {', '.join(skipped)}")
    write_report(args.out, results, skipped, defaults, args.tuple_dtype)
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
