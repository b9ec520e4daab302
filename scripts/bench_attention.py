"""Times paged attention on short prefills over long KV, at a released model's full-attention heads
(default Qwen3.5-35B-A3B's 16 x 256 over 2 KV heads; `--shape nemotron3_nano`: 32 x 128 over 2).

A warm PIC assembly step computes a few hundred tokens (a seam window at the start of each cached
segment, then the query) against the whole prompt's KV. For each case this times
`paged_attention_triton` with the KV splits `Tiling.choose` picks and with one split (the unsplit
prefill path, which first times its wide-head tilings), each as CUDA-graph replays the way the
engine runs assembly steps, and checks both against the torch reference. The warm-assembly cases
also time the split path in each tile of `--tiles` (rows x KV block, 8 warps, 2 stages; the engine
uses SPLIT_TILING), to pick the split grids' tile. Prints a table and writes JSON.

    python scripts/bench_attention.py [--shape nemotron3_nano]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hypic.config import EngineConfig
from hypic.kernels.paged_attention import Tiling, paged_attention_ref, paged_attention_triton
from hypic.kernels.triton_lazy import next_power_of_2
from results import device_label, graph_ms, result_path, run_record

BLOCK_SIZE = EngineConfig.block_size  # the engine's KV page
DTYPE = torch.bfloat16
SEGMENTS, SEAM_TOKENS, QUERY_TOKENS = 16, 16, 64  # seam: 2w at w = 8 (a segment's last w, the next's first w)
CALLS_PER_GRAPH, REPLAYS = 20, 10  # graph replays time the GPU, not the host's launch cost
TOLERANCE = 2e-2  # max abs error allowed, relative to the reference's largest magnitude (bf16)


@dataclass(frozen=True)
class Heads:
    query: int
    kv: int
    dim: int


SHAPES = {"qwen3_5_moe": Heads(16, 2, 256), "nemotron3_nano": Heads(32, 2, 128)}


@dataclass(frozen=True)
class Case:
    name: str
    kv_len: int
    positions: tuple[int, ...]  # one sequence's query positions


@dataclass(frozen=True)
class Step:
    q: torch.Tensor  # [tokens, query heads, head dim]
    k_cache: torch.Tensor  # [pages, BLOCK_SIZE, KV heads, head dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [1, pages] int32
    kv_lens: torch.Tensor  # [1] int32
    positions: torch.Tensor  # [tokens] int64
    cu_seqlens: torch.Tensor  # [2] int32

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return (self.q.shape[0],)

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5


@dataclass(frozen=True)
class Result:
    case: str
    kv_len: int
    tokens: int
    splits: int  # as Tiling.choose picks them
    ms_split: float
    ms_unsplit: float
    speedup: float
    max_abs_err_split: float
    max_abs_err_unsplit: float
    reference_max_abs: float
    ms_by_tile: dict[str, float]  # split path per forced tile "ROWSxKV_BLOCK" (warm assembly cases)
    max_abs_err_by_tile: dict[str, float]


def assembly_positions(kv_len: int) -> tuple[int, ...]:
    """Seam windows at the start of each cached segment spread over the prompt, then the query."""
    prompt = kv_len - QUERY_TOKENS
    seams = [k * prompt // SEGMENTS + i for k in range(SEGMENTS) for i in range(SEAM_TOKENS)]
    return (*seams, *range(prompt, kv_len))


def cases() -> tuple[Case, ...]:
    assembly = tuple(Case("warm assembly", kv_len, assembly_positions(kv_len)) for kv_len in (4096, 16384))
    # a plain chunk near the rule's edge (about two programs per SM unsplit): does splitting still pay?
    return (*assembly, Case("chunk", 4096, tuple(range(4096 - 1000, 4096))))


def make_step(case: Case, gen: torch.Generator, heads: Heads) -> Step:
    """Random KV in shuffled pages, the query tokens at the case's positions (drawn on the CPU, so
    that a seed gives the same data on any device)."""
    pages = -(-case.kv_len // BLOCK_SIZE)
    k_cache, v_cache = (torch.randn(pages, BLOCK_SIZE, heads.kv, heads.dim, generator=gen) for _ in range(2))
    tokens = len(case.positions)
    return Step(q=torch.randn(tokens, heads.query, heads.dim, generator=gen).to("cuda", DTYPE),
                k_cache=k_cache.to("cuda", DTYPE), v_cache=v_cache.to("cuda", DTYPE),
                block_tables=torch.randperm(pages, generator=gen).to("cuda", torch.int32)[None],
                kv_lens=torch.tensor([case.kv_len], dtype=torch.int32, device="cuda"),
                positions=torch.tensor(case.positions, dtype=torch.long, device="cuda"),
                cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32, device="cuda"))


def attend(step: Step, out: torch.Tensor, max_kv_len: int, splits: int | None, shape: Tiling | None) -> None:
    paged_attention_triton(step.q, step.k_cache, step.v_cache, step.block_tables, step.kv_lens, step.positions,
                           step.cu_seqlens, scale=step.scale, out=out, first_seq=0, first_token=0,
                           seq_lens=step.seq_lens, max_kv_len=max_kv_len, splits=splits, shape=shape)


def time_ms(step: Step, max_kv_len: int, splits: int | None,
            shape: Tiling | None = None) -> tuple[float, torch.Tensor]:
    """Milliseconds a call (unsplit, the first call also times the wide tilings once); and the output."""
    out = torch.empty_like(step.q)
    ms = graph_ms(lambda: attend(step, out, max_kv_len, splits, shape), CALLS_PER_GRAPH, REPLAYS)
    return ms, out


def tile_shape(text: str, heads: Heads) -> Tiling:
    """"ROWSxKV_BLOCK" -> the split path's tile at this shape's head group (8 warps, 2 stages)."""
    rows, kv_block = (int(x) for x in text.split("x"))
    return Tiling(rows, next_power_of_2(heads.query // heads.kv), kv_block, 1, 8, 2)


def measure(case: Case, gen: torch.Generator, tiles: list[str], heads: Heads) -> Result:
    step = make_step(case, gen, heads)
    reference = paged_attention_ref(step.q, step.k_cache, step.v_cache, step.block_tables, step.kv_lens,
                                    step.positions, step.cu_seqlens, scale=step.scale, num_decodes=0,
                                    seq_lens_cpu=step.seq_lens, max_kv_len=case.kv_len).float()
    splits = Tiling.choose(step.q, step.k_cache, step.seq_lens, case.kv_len).splits
    ms_split, out_split = time_ms(step, case.kv_len, None)
    ms_unsplit, out_unsplit = time_ms(step, case.kv_len, 1)
    err_split, err_unsplit = ((out.float() - reference).abs().max().item() for out in (out_split, out_unsplit))
    ms_by_tile, err_by_tile = {}, {}
    for tile in tiles if case.name == "warm assembly" else []:
        ms_by_tile[tile], out = time_ms(step, case.kv_len, None, tile_shape(tile, heads))
        err_by_tile[tile] = (out.float() - reference).abs().max().item()
    return Result(case.name, case.kv_len, len(case.positions), splits, ms_split, ms_unsplit, ms_unsplit / ms_split,
                  err_split, err_unsplit, reference.abs().max().item(), ms_by_tile, err_by_tile)


def within_tolerance(result: Result) -> bool:
    """Every path finite and close to the reference (NaN compares False)."""
    limit = TOLERANCE * result.reference_max_abs
    errors = (result.max_abs_err_split, result.max_abs_err_unsplit, *result.max_abs_err_by_tile.values())
    return all(err <= limit for err in errors)


def write_report(out: Path, results: list[Result], heads: Heads) -> None:
    report = dict(**run_record(),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=str(DTYPE),
                  heads=heads.query, kv_heads=heads.kv, head_dim=heads.dim, block_size=BLOCK_SIZE,
                  segments=SEGMENTS, seam_tokens=SEAM_TOKENS, query_tokens=QUERY_TOKENS,
                  results=[asdict(r) for r in results])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3_5_moe")
    parser.add_argument("--out", type=Path, help="default: bench/results/attention_<device>_<shape>.json")
    parser.add_argument("--tiles", type=lambda s: s.split(","), default=["64x32", "128x32", "64x64", "128x64"],
                        help="split-path tiles ROWSxKV_BLOCK timed on the warm assembly cases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py times the Triton kernel: it needs a CUDA device")
    args.out = args.out or result_path("attention", device_label(torch.cuda.get_device_name()), args.shape)
    heads = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: {heads.query} heads / {heads.kv} KV heads x {heads.dim}, {DTYPE}, "
          f"pages of {BLOCK_SIZE}")
    print(f"{'case':14} {'kv':>6} {'tokens':>6} {'splits':>6} {'ms split':>9} {'ms 1':>9} {'speedup':>7} "
          f"{'err split':>10} {'err 1':>10}")
    results = []
    for case in cases():
        result = measure(case, gen, args.tiles, heads)
        results.append(result)
        print(f"{result.case:14} {result.kv_len:6} {result.tokens:6} {result.splits:6} {result.ms_split:9.4f} "
              f"{result.ms_unsplit:9.4f} {result.speedup:7.2f} {result.max_abs_err_split:10.2e} "
              f"{result.max_abs_err_unsplit:10.2e}", *(f"{t} {ms:.4f}" for t, ms in result.ms_by_tile.items()),
              flush=True)
        write_report(args.out, results, heads)  # after every case: a killed run keeps what it measured
    print(f"wrote {args.out}")
    failed = [r.case + f" kv={r.kv_len}" for r in results if not within_tolerance(r)]
    if failed:
        raise SystemExit(f"outputs differ from the reference by more than {TOLERANCE} of its magnitude: {failed}")


if __name__ == "__main__":
    main()
