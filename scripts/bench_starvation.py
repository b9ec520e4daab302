"""What starves what under RAG load (issue 26, item 2), measured with `hypic bench serve`.

(a) Decodes against a long cold segment: `--decoders` requests decode `--decode-tokens` tokens each;
    `--cold-at` seconds in, one request brings a cold document of `--long-tokens` tokens. Reported:
    the decoders' inter-token latency (p99 and worst gap) with and without that request, and how much
    of its prefill the decoders were still decoding through (`overlap_fraction`: below 1, a warning).
(b) Warm requests against cold ones: the RAG workload, preheated; its saturated rate first, then
    half of it with `--cold-fraction` of documents new. Reported: the p99 TTFT of requests with no
    cold document, at half saturation and when alone (one request at a time).
Acceptance of item 2: both loaded figures within 2x their idle ones.

    python scripts/bench_starvation.py --out bench/results/starvation_cpu_default_model.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from hypic.bench.report import run_record, write_json
from hypic.bench.serve import started_server
from hypic.bench.stats import percentile
from hypic.cli import main as hypic

CPU_SERVER = "python3 -m hypic.serve --log-level warning --device cpu --max-model-len 16384 --max-num-batched-tokens 1024"
RAG = ["--documents", "40", "--doc-tokens", "512", "--docs-per-request", "4", "--system-tokens", "32",
       "--question-tokens", "16", "--max-tokens", "16", "--preheat"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-command", default=CPU_SERVER, help="(default: %(default)s)")
    parser.add_argument("--cache-mode", default="hypic", help="(default: %(default)s)")
    parser.add_argument("--long-tokens", type=int, default=16000, help="(default: %(default)s)")
    parser.add_argument("--decoders", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--decode-tokens", type=int, default=1024, help="(default: %(default)s)")
    parser.add_argument("--cold-at", type=float, default=0.5, help="(default: %(default)s)")
    parser.add_argument("--cold-fraction", type=float, default=0.1, help="(default: %(default)s)")
    parser.add_argument("--requests", type=int, default=40, help="RAG requests per point (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/starvation_cpu_default_model.json"))
    return parser.parse_args()


def bench(url: str, work: Path, name: str, *options: str) -> dict:
    """One `hypic bench serve` run; its only series' points."""
    out = work / f"{name}.json"
    if hypic(["bench", "serve", "--url", url, "--no-progress", "--no-plot", "--out", str(out), *options]) != 0:
        sys.exit(f"bench serve failed: {name}")
    return json.loads(out.read_text())["series"][0]["points"]


def decode_traces(args: argparse.Namespace, work: Path, seed: int) -> tuple[Path, Path]:
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(100, 3000) for _ in range(count)]
    system = ids(32)
    decoders = [{"timestamp": 0.1 * i, "segments": [system, ids(16)], "max_tokens": args.decode_tokens}
                for i in range(args.decoders)]
    cold = {"timestamp": args.cold_at, "segments": [system, ids(args.long_tokens), ids(16)], "max_tokens": 4}
    paths = work / f"decoders_{seed}.jsonl", work / f"decoders_and_cold_{seed}.jsonl"
    for path, lines in zip(paths, (decoders, [*decoders, cold])):
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return paths


def decode_stall(url: str, args: argparse.Namespace, work: Path) -> dict:
    """After a warm-up round of other tokens: a server's first long prefill compiles and tunes its
    kernels for the long shapes, seconds that no later prefill pays."""
    bench(url, work, "warm_up", "--trace", str(decode_traces(args, work, seed=1)[1]), "--cache-modes", args.cache_mode)
    figures = {}
    for name, trace in zip(("alone", "with_cold_prefill"), decode_traces(args, work, seed=0)):
        point, = bench(url, work, name, "--trace", str(trace), "--cache-modes", args.cache_mode)
        decoders = point["samples"][:args.decoders]
        figures[name] = {"itl_p99_s": point["itl_p99_s"], "worst_gap_s": max(s["itl_max_s"] for s in decoders),
                         "long_request_ttft_s": point["samples"][-1]["ttft_s"] if name != "alone" else None}
        if name != "alone":
            figures["overlap_fraction"] = overlap_fraction(decoders, point["samples"][-1])
    figures["itl_p99_ratio"] = figures["with_cold_prefill"]["itl_p99_s"] / figures["alone"]["itl_p99_s"]
    return figures


def overlap_fraction(decoders: list[dict], cold: dict) -> float:
    """How much of the cold request's prefill (its send to its first token) every decoder was still
    decoding through. Below 1 the ITL figures miss part of the stall (at 0 all of it): the decoders
    finished first, so raise --decode-tokens or lower --cold-at."""
    start, first_token = cold["sent_s"], cold["sent_s"] + cold["ttft_s"]
    decoding = max(start, min(min(d["sent_s"] + d["e2e_s"] for d in decoders), first_token)) - start
    fraction = decoding / (first_token - start)
    if fraction < 1:
        print(f"warning: the decoders decoded through {fraction:.0%} of the cold prefill only: the ITL figures "
              "do not measure its stall (raise --decode-tokens or lower --cold-at)", file=sys.stderr)
    return fraction


def warm_ttft(url: str, args: argparse.Namespace, work: Path) -> dict:
    common = [*RAG, "--cache-modes", args.cache_mode, "--cold-fraction", str(args.cold_fraction),
              "--num-requests", str(args.requests)]
    saturated, = bench(url, work, "saturated", *common, "--request-rate", "inf")
    half = saturated["achieved_rps"] / 2
    idle, = bench(url, work, "idle", *common, "--max-concurrency", "1", "--seed", "1")
    loaded, = bench(url, work, "loaded", *common, "--request-rate", f"{half:.4f}", "--seed", "2")
    figures = {"saturated_rps": saturated["achieved_rps"], "half_rate": half}
    for name, point in (("idle", idle), ("loaded", loaded)):
        warm = [s["ttft_s"] for s in point["samples"] if s["cold_segments"] == 0 and s["ttft_s"] is not None]
        cold = [s["ttft_s"] for s in point["samples"] if s["cold_segments"] > 0 and s["ttft_s"] is not None]
        figures[name] = {"warm_ttft_p50_s": percentile(warm, 50), "warm_ttft_p99_s": percentile(warm, 99),
                         "cold_ttft_p50_s": percentile(cold, 50), "warm": len(warm), "cold": len(cold)}
    figures["warm_ttft_p99_ratio"] = figures["loaded"]["warm_ttft_p99_s"] / figures["idle"]["warm_ttft_p99_s"]
    return figures


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory() as directory, started_server(
            argparse.Namespace(url=None, server_command=args.server_command)) as (url, startup):
        work = Path(directory)
        result = {"benchmark": "starvation", **run_record(), "startup_line": startup,
                  "decode_stall": decode_stall(url, args, work), "warm_ttft": warm_ttft(url, args, work)}
    write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
