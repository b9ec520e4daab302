"""Issue 26's Fig. 11 experiment on one H200 in parts, one device call (at most 9 minutes) each, every
part merged into one result file (docs/bench-serve.md has what each part costs):

    python scripts/bench_fig11.py hypic --out-dir $OUT    # a call; then none, then prefix, a call each
    python scripts/bench_fig11.py pool5x --out-dir $OUT   # the corpus 5x the segment pool: a file of its own
    python scripts/bench_fig11.py none --rates 4,6,inf --out-dir $OUT   # the points a timed-out call missed
    python scripts/bench_fig11.py none prefix --rates 2,3,4,inf --out-dir $OUT   # two parts, one server

The workload: the Qwen3.5-35B-A3B text shape with random bf16 weights (scripts/serve_shape.py), one
engine with the cache mode per request, RAG prompts of 8 documents of ~1.5k tokens (~12.1k tokens) from
100 (Zipf 1, preheated), 32 output tokens, 100 requests or 60 s a rate point, p50 TTFT SLO 1 s. The
engine runs with no long-prefill cap (`--long-prefill-token-threshold 0`): with the GPU default (512)
every none and prefix prompt is a long prefill held to 512 tokens a step while any request decodes, so
their TTFT would measure the cap (it bounds decode gaps, scripts/bench_starvation.py), not the caches;
vLLM's default chunked prefill also takes the whole step. pool5x: a pool of 1800 MiB (~19 of the 100
documents of ~95 MB) and no host tier, so misses and evictions are in the mix.

A part merges into the committed result (bench/results/), which it copies to --out-dir first; with no
committed result (or --fresh) it starts the file. Every part's settings but its modes and rates are the
same, so the merge's check passes.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

from results import RESULTS_DIR, result_path

from hypic.cli import main as hypic

# part: (cache mode, rates, pool options of the server, result's shape); rates reach each mode's saturation
PARTS = {
    "hypic": ("hypic", "1,2,4,8,16,24,32,48,64,inf", "--segment-pool-bytes 12GiB", "qwen3_5_moe_fig11"),
    "none": ("none", "1,2,3,4,6,inf", "--segment-pool-bytes 12GiB", "qwen3_5_moe_fig11"),
    "prefix": ("prefix", "1,2,3,4,6,inf", "--segment-pool-bytes 12GiB", "qwen3_5_moe_fig11"),
    "pool5x": ("hypic", "1,2,3,4,6,8,12,inf", "--segment-pool-bytes 1800MiB --segment-host-bytes 0",
               "qwen3_5_moe_fig11_pool5x"),
}
SERVER = ("python scripts/serve_shape.py --shape qwen3_5_moe --device cuda --max-model-len 16384 "
          "--long-prefill-token-threshold 0 --log-level warning")
WORKLOAD = ("--documents 100 --doc-tokens 1500 --docs-per-request 8 --zipf-s 1 --max-tokens 32 --preheat "
            "--warmup 16 --num-requests 100 --duration 60 --slo-ttft 1 --no-progress")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="+", choices=PARTS, help="parts of one server and result file")
    parser.add_argument("--rates", help="the part's rates to measure (default: all of them)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="(default: bench/results)")
    parser.add_argument("--fresh", action="store_true", help="start the file, merging nothing")
    return parser.parse_args(argv)


def bench_argv(parts: list[str], rates: str | None, out: Path, merge: bool) -> list[str]:
    """The `hypic bench serve` command line of parts sharing a server: one series each."""
    settings = {PARTS[part][1:] for part in parts}
    if len(settings) > 1:
        raise SystemExit(f"bench_fig11: parts {parts} differ in rates, server or result file: run them apart")
    (all_rates, pool, _), = settings
    modes = ",".join(PARTS[part][0] for part in parts)
    return ["bench", "serve", "--server-command", f"{SERVER} {pool}", *shlex.split(WORKLOAD), "--cache-modes", modes,
            "--request-rate", rates or all_rates, "--out", str(out), *(["--merge"] if merge else [])]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = result_path("bench_serve", "h200", PARTS[args.parts[0]][3]).name
    out, committed = args.out_dir / name, RESULTS_DIR / name
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.fresh and committed.exists() and committed.resolve() != out.resolve():
        shutil.copyfile(committed, out)
    command = bench_argv(args.parts, args.rates, out, merge=not args.fresh and out.exists())
    print("hypic " + shlex.join(command), flush=True)
    return hypic(command)


if __name__ == "__main__":
    sys.exit(main())
