"""Times the MLA latent kernel at the Kimi-Linear-48B-A3B shape (32 heads, kv_lora_rank 512, rope 64).

Cases: a warm PIC assembly step (seam windows at the start of each of 16 cached segments, then the
question, against the whole prompt's latents) at 4k and 16k keys, and decode batches over long
contexts. Each case times `mla_attention_triton` with the tile `LatentTiling.choose` picks, and with
each tile of `--tiles` (TOKENSxPARTSxKV_BLOCK, 8 warps, splits as `latent_splits` picks them for it),
as CUDA-graph replays the way the engine runs these steps, and checks the outputs against the torch
reference. Prints a table and writes JSON.

    python scripts/bench_mla.py
    python scripts/bench_mla.py --tiles 4x2x32,2x2x32,2x2x16
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hypic.config import EngineConfig
from hypic.kernels.mla_attention import LatentTiling, latent_splits, mla_attention_ref, mla_attention_triton
from results import device_label, graph_ms, result_path, run_record, write_json

HEADS, RANK, ROPE, QK_HEAD_DIM = 32, 512, 64, 192  # Kimi-Linear-48B-A3B's MLA
BLOCK_SIZE = EngineConfig.block_size
SEGMENTS, SEAM_TOKENS, QUERY_TOKENS = 16, 8, 32  # ~160 walked tokens, as a warm 16 x 1024 request
TOLERANCE = 2e-2  # max abs error allowed, relative to the reference's largest magnitude (bf16)


@dataclass(frozen=True)
class Case:
    name: str
    kv_lens: tuple[int, ...]  # per sequence
    positions: tuple[tuple[int, ...], ...]  # per sequence, its query positions


def cases() -> tuple[Case, ...]:
    def assembly(kv_len: int) -> Case:
        prompt = kv_len - QUERY_TOKENS
        seams = [k * prompt // SEGMENTS + i for k in range(SEGMENTS) for i in range(SEAM_TOKENS)]
        return Case("warm assembly", (kv_len,), ((*seams, *range(prompt, kv_len)),))

    def decode(batch: int, kv_len: int) -> Case:
        return Case(f"decode x{batch}", (kv_len,) * batch, ((kv_len - 1,),) * batch)
    return assembly(4096), assembly(16384), decode(1, 16384), decode(32, 4096), decode(128, 4096)


@dataclass(frozen=True)
class Step:
    q_abs: torch.Tensor  # [tokens, HEADS, RANK + ROPE]
    pages: torch.Tensor  # [pages, BLOCK_SIZE, 1, RANK + ROPE]
    block_tables: torch.Tensor  # [B, max pages] int32
    kv_lens: torch.Tensor  # [B] int32
    positions: torch.Tensor  # [tokens] int64
    cu_seqlens: torch.Tensor  # [B + 1] int32
    seq_lens: tuple[int, ...]  # host copies: nothing is read back inside a graph capture
    max_kv_len: int


def make_step(case: Case, gen: torch.Generator) -> Step:
    """Random latents in shuffled pages (drawn on the CPU: a seed gives the same data on any device)."""
    need = [-(-n // BLOCK_SIZE) for n in case.kv_lens]
    order = torch.randperm(sum(need), generator=gen).to(torch.int32)
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    for b, (start, n) in enumerate(zip([0, *torch.tensor(need).cumsum(0).tolist()], need)):
        tables[b, :n] = order[start:start + n]
    seq_lens = tuple(len(p) for p in case.positions)
    cuda = {"device": "cuda"}
    return Step(q_abs=(torch.randn(sum(seq_lens), HEADS, RANK + ROPE, generator=gen) / 4).to("cuda", torch.bfloat16),
                pages=torch.randn(sum(need), BLOCK_SIZE, 1, RANK + ROPE, generator=gen).to("cuda", torch.bfloat16),
                block_tables=tables.cuda(), kv_lens=torch.tensor(case.kv_lens, dtype=torch.int32, **cuda),
                positions=torch.tensor([p for ps in case.positions for p in ps], **cuda),
                cu_seqlens=torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, **cuda),
                seq_lens=seq_lens, max_kv_len=max(case.kv_lens))


def attend(step: Step, tiling: LatentTiling | None) -> torch.Tensor:
    return mla_attention_triton(step.q_abs, step.pages, step.block_tables, step.kv_lens, step.positions,
                                step.cu_seqlens, scale=QK_HEAD_DIM ** -0.5, rank=RANK, seq_lens_cpu=step.seq_lens,
                                max_kv_len=step.max_kv_len, tiling=tiling)


def forced(text: str, step: Step) -> LatentTiling:
    """"TOKENSxPARTSxKV_BLOCK" -> that tile over all heads, split as latent_splits picks for it."""
    tokens, parts, kv_block = (int(x) for x in text.split("x"))
    tiling = LatentTiling(tokens, HEADS, parts, kv_block, 1, 8)
    splits = latent_splits(tiling.programs(step.seq_lens, HEADS), step.max_kv_len, torch.device("cuda"))
    return dataclasses.replace(tiling, splits=splits)


def measure(case: Case, gen: torch.Generator, tiles: list[str]) -> dict:
    """ms and max abs error of the chosen tile and of each forced one."""
    step = make_step(case, gen)
    reference = mla_attention_ref(step.q_abs, step.pages, step.block_tables, step.kv_lens, step.positions,
                                  step.cu_seqlens, scale=QK_HEAD_DIM ** -0.5, rank=RANK, seq_lens_cpu=step.seq_lens,
                                  max_kv_len=step.max_kv_len).float()
    chosen = LatentTiling.choose(step.q_abs, RANK, step.seq_lens, step.max_kv_len)
    runs = {"chosen": chosen, **{tile: forced(tile, step) for tile in tiles}}
    result = {"case": case.name, "kv_len": step.max_kv_len, "tokens": len(step.positions),
              "reference_max_abs": reference.abs().max().item(), "tiles": {}}
    for name, tiling in runs.items():
        ms = graph_ms(lambda tiling=tiling: attend(step, tiling))
        err = (attend(step, tiling).float() - reference).abs().max().item()
        result["tiles"][name] = {"tiling": asdict(tiling), "ms": ms, "max_abs_err": err}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="default: bench/results/mla_<device>_kimi_linear_48b.json")
    parser.add_argument("--tiles", type=lambda s: [t for t in s.split(",") if t], default=["4x2x32", "2x2x32"],
                        help="forced tiles TOKENSxPARTSxKV_BLOCK timed beside the chosen one")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla.py times the Triton kernel: it needs a CUDA device")
    out = args.out or result_path("mla", device_label(torch.cuda.get_device_name()), "kimi_linear_48b")
    gen, results = torch.Generator().manual_seed(0), []
    for case in cases():
        results.append(result := measure(case, gen, args.tiles))
        print(f"{result['case']:14} kv {result['kv_len']:6} tokens {result['tokens']:4}", *(
            f"| {name} {t['tiling']['tokens']}x{t['tiling']['parts']}x{t['tiling']['kv_block']}/{t['tiling']['splits']}"
            f" {t['ms']:.4f} ms err {t['max_abs_err']:.1e}" for name, t in result["tiles"].items()), flush=True)
        write_json(out, dict(**run_record(), device=torch.cuda.get_device_name(), torch=torch.__version__, heads=HEADS,
                             rank=RANK, rope=ROPE, block_size=BLOCK_SIZE, results=results))  # a killed run keeps its cases
    print(f"wrote {out}")
    failed = [f"{r['case']} kv={r['kv_len']} {name}" for r in results for name, t in r["tiles"].items()
              if not t["max_abs_err"] <= TOLERANCE * r["reference_max_abs"]]
    if failed:
        raise SystemExit(f"outputs differ from the reference by more than {TOLERANCE} of its magnitude: {failed}")


if __name__ == "__main__":
    main()
