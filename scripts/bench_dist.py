"""Segment parallelism benchmarks (DESIGN §6, paper §6 Fig. 14). Writes JSON and a PNG beside it.

one-gpu   On one GPU: (1) the cluster path with one engine process against the in-process engine
          (the overhead of going through the router; target <= 5 %), and (2) two engine processes
          sharing the GPU, joined by the TCP data plane (NCCL refuses two ranks on one GPU): cold
          requests are split between them, and the report shows how much of the tuple transfers the
          prefill of the next segments hid (1 - exposed comm / total send time).
fig14     On several GPUs (issue 7): 11 cold segments x 2.4k tokens on 1/2/4/8 workers, one per GPU,
          NCCL: TTFT and its breakdown (dispatch forward / comm / combine) against full recompute
          (`none`) and serial cold hypic (1 worker); then LPT against round-robin on uneven segments.

    python scripts/bench_dist.py one-gpu
    python scripts/bench_dist.py fig14 --workers 1,2,4,8
    python scripts/bench_dist.py one-gpu --model DIR --device cpu --docs 3 --doc-tokens 64   # smoke run

Weights are random (bf16, on each GPU, from one seed: every process builds the same model) on a
released shape (one-gpu: the dense Qwen3.5 text model, two copies fit one H200; fig14: Qwen3.5-35B-A3B).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_engine import model_dir, random_weights, shape_config

from hypic import EngineConfig, SamplingParams
from hypic.dist.config import DistConfig
from hypic.dist.client import start_cluster
from hypic.engine.text.tokenizer import Tokenizer
from hypic.engine.client import EngineClient, GenerateRequest, InProcessEngineClient
from results import device_label, result_path, run_record

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


# -- workload ---------------------------------------------------------------------------------------

class Texts:
    """Random documents of an exact token count: words that are one token each, preceded by a space."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.rng = random.Random(seed)
        pieces = [tokenizer.decode([i]) for i in range(3, tokenizer.vocab_size)]
        words = [w for w in pieces if len(w) > 2 and w[0] == " " and w[1:].isalpha()]
        if len(words) < 100:  # a tiny tokenizer (smoke runs): counts are approximate
            words = [w for w in pieces if w.strip()]
        self.words = [w for w in words if len(tokenizer.encode(w)) == 1][:20000]

    def doc(self, tokens: int) -> str:
        return "".join(self.rng.choice(self.words) for _ in range(tokens))

    def prompt(self, docs: list[str]) -> list[str]:
        return [self.doc(64), *docs, self.doc(64)]  # system prompt, documents, question


# -- measuring one client ---------------------------------------------------------------------------

async def first_token(client: EngineClient, segments: list[str], mode: str = "hypic") -> dict[str, Any]:
    request = GenerateRequest(segments, FIRST_TOKEN, f"bench-{time.monotonic_ns()}", cache_mode=mode)
    start, ttft = time.perf_counter(), float("nan")
    async for output in client.stream(request):
        if any(d.token_ids for d in output.deltas):
            ttft = time.perf_counter() - start
    dist = getattr(output.metrics, "dist", None)
    return {"ttft_s": ttft, "prompt_tokens": output.metrics.prompt_tokens,
            "dist": dataclasses.asdict(dist) if dist is not None else None}


async def sent_seconds(client: EngineClient) -> float:
    """Seconds every node spent sending tuples so far (0 for an in-process engine)."""
    nodes = getattr(client, "cluster", None)
    if nodes is None:
        return 0.0
    replies = [await client.probe(node_id) for node_id in list(nodes.nodes)]
    return sum(r.counters.send_seconds for r in replies)


async def cold_and_warm(client: EngineClient, texts: Texts, sizes: list[int], repeats: int,
                        none: bool) -> dict[str, Any]:
    """Median-of-repeats TTFT of cold prompts (new documents each time), the same documents warm in a
    new order, and optionally `none` (full recompute)."""
    runs: dict[str, list] = {"cold": [], "warm": [], "none": []}
    for _ in range(repeats):
        docs = [texts.doc(n) for n in sizes]
        before = await sent_seconds(client)
        cold = await first_token(client, texts.prompt(docs))
        cold["send_s"] = await sent_seconds(client) - before
        runs["cold"].append(cold)
        runs["warm"].append(await first_token(client, texts.prompt(random.sample(docs, len(docs)))))
        if none:
            runs["none"].append(await first_token(client, texts.prompt(docs), "none"))
    return {kind: summarise(items) for kind, items in runs.items() if items}


def summarise(items: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [i["ttft_s"] for i in items]
    out = {"ttft_s": statistics.median(ttft), "ttft_all_s": ttft, "prompt_tokens": items[0]["prompt_tokens"]}
    dists = [i["dist"] for i in items if i["dist"] is not None]
    for name in ("dispatch_s", "comm_s", "combine_s", "plan_s") if dists else ():
        out[name] = statistics.median(d[name] for d in dists)
    sends = [i["send_s"] for i in items if i.get("send_s")]
    if dists and sends:
        out["send_s"] = statistics.median(sends)
        out["transfer_hidden_fraction"] = max(0.0, 1.0 - out["comm_s"] / out["send_s"])
    if dists:
        out["workers"] = dists[0]["workers"]
    return out


async def measure(client: EngineClient, texts: Texts, prompts: dict[str, list[int]], repeats: int,
                  none: bool) -> dict[str, dict]:
    """Cold/warm (and optionally `none`) TTFT of each named set of segment sizes, on one started client."""
    await client.start()
    try:
        for sizes in prompts.values():  # warm-up: kernels compile and autotune for every shape measured
            await cold_and_warm(client, texts, sizes, 1, none)
        return {name: await cold_and_warm(client, texts, sizes, repeats, none) for name, sizes in prompts.items()}
    finally:
        await client.shutdown(0.0)


# -- the experiments --------------------------------------------------------------------------------

def one_gpu(args: argparse.Namespace, base: EngineConfig, configure: Any, texts: Texts) -> dict:
    prompts = {"docs": [args.doc_tokens] * args.docs}
    gpus = None if args.device == "cpu" else [0]
    two = DistConfig(transport="tcp", min_remote_tokens=0)
    result = {
        "cluster_1_worker": run(measure(start_cluster(base, 1, gpus, args.device, configure=configure),
                                        texts, prompts, args.repeats, False))["docs"],
        "cluster_2_workers_tcp": run(measure(start_cluster(base, 2, gpus, args.device, two, configure=configure),
                                             texts, prompts, args.repeats, False))["docs"],
    }
    local = InProcessEngineClient(configure(base) if configure else base)
    result["local"] = run(measure(local, texts, prompts, args.repeats, True))["docs"]
    del local
    gc.collect()
    for kind in ("cold", "warm"):
        result[f"overhead_1_worker_{kind}"] = result["cluster_1_worker"][kind]["ttft_s"] / result["local"][kind]["ttft_s"] - 1
    return result


UNEVEN = (2.0, 0.4, 1.6, 0.4, 1.2, 0.6, 1.8, 0.4, 0.8, 1.4, 0.4)  # segment lengths, in doc_tokens


def fig14(args: argparse.Namespace, base: EngineConfig, configure: Any, texts: Texts) -> dict:
    """Per worker count, one cluster per assignment: equal segments (args.docs, and 16), and uneven
    ones; efficiency is the speedup over serial isolated prefill (1 worker) against n / ceil(n / m)."""
    available = torch.cuda.device_count() if args.device != "cpu" else max(args.workers)
    prompts = {"equal": [args.doc_tokens] * args.docs, "equal16": [args.doc_tokens] * 16,
               "uneven": [int(args.doc_tokens * f) for f in UNEVEN][: args.docs]}
    result: dict[str, Any] = {name: {} for name in prompts} | {"skipped": [n for n in args.workers if n > available]}
    for n in [n for n in args.workers if n <= available]:
        gpus = None if args.device == "cpu" else list(range(n))
        for assignment in ("lpt", "round_robin") if n > 1 else ("lpt",):
            wanted = prompts if assignment == "lpt" else {"uneven": prompts["uneven"]}
            client = start_cluster(base, n, gpus, args.device, DistConfig(min_remote_tokens=0, assignment=assignment),
                                   configure=configure)
            for name, row in run(measure(client, texts, wanted, args.repeats, none=n == 1)).items():
                result[name][f"{n}_{assignment}"] = row
                print(f"{name:>7} {n}_{assignment:>12}: TTFT {row['cold']['ttft_s'] * 1e3:8.1f} ms", flush=True)
    result["efficiency"] = efficiency(result, prompts)
    return result


def efficiency(result: dict, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """Cold speedup over 1 worker and over `none`, and the share of the ideal n / ceil(n / m)."""
    table: dict[str, dict] = {}
    for name in ("equal", "equal16"):
        serial = result[name].get("1_lpt")
        if serial is None:
            continue
        n = len(prompts[name])
        for key, row in result[name].items():
            m = int(key.split("_")[0])
            speedup = serial["cold"]["ttft_s"] / row["cold"]["ttft_s"]
            table[f"{name}_{key}"] = {"speedup_vs_serial": speedup, "ideal": n / math.ceil(n / m),
                                      "efficiency": speedup / (n / math.ceil(n / m)),
                                      "speedup_vs_none": serial["none"]["ttft_s"] / row["cold"]["ttft_s"]}
    return table


# -- plumbing ---------------------------------------------------------------------------------------

def run(work: Any) -> Any:
    try:
        import uvloop
        return uvloop.run(work)
    except ImportError:
        return asyncio.run(work)


def with_random_weights(config: EngineConfig, shape: dict, seed: int) -> EngineConfig:
    """In each node process: the shape's random weights, built on its GPU (same seed everywhere)."""
    return dataclasses.replace(config, state_dict=random_weights(shape, seed))


def setup(args: argparse.Namespace) -> tuple[EngineConfig, Any, str]:
    common = dict(max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=32, seam_width=8)  # graphs on: a warm or combine step replays its assembly graph
    if args.model:
        return EngineConfig(model=args.model, device=args.device, **common), None, args.model
    shape = shape_config(args.shape, args.max_model_len)
    directory = str(model_dir(shape))
    config = EngineConfig(model=directory, device="cuda", gpu_memory_utilization=0.85, **common)
    return config, functools.partial(with_random_weights, shape=shape, seed=0), directory


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = result["rows"]
    names = list(rows)
    local = [rows[n]["ttft_s"] * 1e3 if "dispatch_s" not in rows[n] else 0.0 for n in names]
    ax.bar(names, local, color="#8c8c8c", label="local path (no breakdown)")
    bottom = [0.0] * len(names)
    for part, color in (("dispatch_s", "#4c72b0"), ("comm_s", "#dd8452"), ("combine_s", "#55a868")):
        values = [rows[n].get(part, 0.0) * 1e3 for n in names]
        ax.bar(names, values, bottom=bottom, color=color, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(names, [rows[n]["ttft_s"] * 1e3 for n in names], color="black", zorder=3, label="TTFT")
    if result.get("none_ttft_s"):
        ax.axhline(result["none_ttft_s"] * 1e3, color="gray", linestyle="--", label="none (recompute)")
    ax.set_ylabel("ms")
    ax.set_title(result["title"])
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(chart: dict) -> None:
    none = chart.get("none_ttft_s")
    print(chart["title"])
    print(f"{'configuration':>26} {'TTFT ms':>9} {'dispatch':>9} {'comm':>7} {'combine':>8} {'vs none':>8}")
    for name, row in chart["rows"].items():
        parts = [f"{row.get(p, float('nan')) * 1e3:{w}.1f}" for p, w in (("dispatch_s", 9), ("comm_s", 7), ("combine_s", 8))]
        speedup = f"{none / row['ttft_s']:7.2f}x" if none else ""
        print(f"{name:>26} {row['ttft_s'] * 1e3:9.1f} {' '.join(parts)} {speedup}")


def chart_rows(experiment: str, result: dict) -> dict:
    """The bars to draw: cold TTFT and its breakdown per configuration."""
    if experiment == "one-gpu":
        rows = {name: result[name]["cold"] for name in ("local", "cluster_1_worker", "cluster_2_workers_tcp")}
        return {"rows": rows, "none_ttft_s": result["local"]["none"]["ttft_s"],
                "title": "one GPU: cold TTFT (overhead, and transfer hidden behind prefill)"}
    rows = {k: v["cold"] for k, v in result["equal"].items()}
    rows.update({f"16 segs {k}": v["cold"] for k, v in result["equal16"].items()})
    rows.update({f"uneven {k}": v["cold"] for k, v in result["uneven"].items()})
    none = result["equal"].get("1_lpt", {}).get("none", {}).get("ttft_s")
    return {"rows": rows, "none_ttft_s": none, "title": "Fig. 14: cold TTFT vs workers"}


def default_out(args: argparse.Namespace, result: dict) -> Path:
    """One engine a GPU, so fig14 ran on as many GPUs as its largest cluster that was not skipped."""
    gpus = 1 if args.experiment == "one-gpu" else min(max(args.workers), max(torch.cuda.device_count(), 1))
    shape = Path(args.model).name if args.model else args.shape
    return result_path(f"dist_{args.experiment.replace('-', '_')}", device_label(result["device"], gpus), shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=("one-gpu", "fig14"))
    parser.add_argument("--shape", help="released shape with random weights (default: qwen3_5 for one-gpu, "
                                        "qwen3_5_moe for fig14)")
    parser.add_argument("--model", help="a model directory instead of a random shape (CPU smoke runs)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--docs", type=int, default=11)
    parser.add_argument("--doc-tokens", type=int, default=2400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, help="default: bench/results/dist_<experiment>_<device>_<shape>.json")
    args = parser.parse_args()
    args.shape = args.shape or ("qwen3_5" if args.experiment == "one-gpu" else "qwen3_5_moe")
    base, configure, directory = setup(args)
    texts = Texts(Tokenizer.from_dir(directory), seed=0)
    result = (one_gpu if args.experiment == "one-gpu" else fig14)(args, base, configure, texts)
    result.update(**run_record(), experiment=args.experiment,
                  device=torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                  shape=None if args.model else args.shape, docs=args.docs, doc_tokens=args.doc_tokens)
    args.out = args.out or default_out(args, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(chart_rows(args.experiment, result), args.out.with_suffix(".png"))
    report(chart_rows(args.experiment, result))
    print(json.dumps({k: v for k, v in result.items() if k.startswith("overhead") or k == "efficiency"}, indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
