"""PIC speed on one GPU (paper Fig. 12): TTFT of `none`, `prefix` and warm `hypic` on RAG prompts.

Prompt = a system prefix + n documents + a question, random tokens, on a released shape with random
bf16 weights (default: Qwen3.5-35B-A3B text). Each measured request puts the documents in an order
never seen before, so the prefix cache can only reuse the system prompt, while hypic reuses every
document. Also: the same hypic prompt once more (`repeat`: it resumes from its last-token
checkpoint, past every document), the marginal TTFT of one more cached segment, and the
tuple-building overhead of a cold segment prefill. Prints each figure as it is measured and a table
at the end; writes JSON under bench/results/ after each figure (hypic.bench.report's ResultFile): a
run of some lengths, counts or the overhead merges into an existing file of the same shape and setup
(`--lengths ''`, `--counts ''`, `--overhead ''` measure none of that kind), so a large shape's figures
can be measured in several short calls (docs/benchmarks.md has the plan for kimi_linear_48b).

    python scripts/bench_pic.py
    python scripts/bench_pic.py --model hypic/assets/default_model --lengths 64 --counts 2,4 --count-len 64 \
        --overhead 2x64 --repeats 1 --out /tmp/pic.json       # CPU smoke run, seconds
"""
from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from pathlib import Path

import torch
from bench_engine import model_dir, random_weights, shape_config

from hypic import EngineConfig, SamplingParams
from hypic.bench.report import ResultFile
from hypic.config import SEGMENT_STATE_DTYPES
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.kernels.host_copy import sync_sites
from results import (by_number, device_label, group, grouped_result, int_list, phase, result_path, say,
                     segment_state_dtype_name, started_engine, variant)

SYSTEM_TOKENS, QUERY_TOKENS = 64, 64
KINDS = ("by_length", "by_count")  # 4 documents of each length; documents of one length, by count


def rag_prompt(docs: list[tuple[int, ...]], system: tuple[int, ...], query: tuple[int, ...]) -> SegmentedPrompt:
    return SegmentedPrompt((system, *docs, query))


def random_tokens(n: int, rng: random.Random, vocab: int = 3000) -> tuple[int, ...]:
    """Ids in [3, vocab): an engine's served_vocab_size, or 3000 (below every shape's vocabulary) for
    prompts drawn before the engine starts."""
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft(engine: LLMEngine, prompt: SegmentedPrompt, mode: str) -> float:
    return timed_request(engine, prompt, mode)[0]


def timed_request(engine: LLMEngine, prompt: SegmentedPrompt, mode: str) -> tuple[float, dict[str, int]]:
    """Seconds to the first token of one request run alone, and its cached prompt tokens by kind."""
    sync()
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_mode=mode)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return time.perf_counter() - start, outputs[-1].metrics.cached_tokens_by_kind


def measure(engine: LLMEngine, num_docs: int, doc_len: int, rng: random.Random, repeats: int) -> dict[str, float]:
    """Median TTFT (s) per mode. Cold: documents never seen, after one unmeasured cold prompt of the
    same shape (kernels compile and autotune for it). Warm: the last cold documents in new orders.
    Repeat: the warm hypic prompt once more (it resumes from its own last-token checkpoint)."""
    vocab = engine.served_vocab_size
    system = random_tokens(SYSTEM_TOKENS, rng, vocab)
    times: dict[str, list[float]] = {"none": [], "prefix": [], "hypic": [], "hypic_cold": [], "hypic_repeat": []}
    for round_ in range(repeats + 1):
        docs = [random_tokens(doc_len, rng, vocab) for _ in range(num_docs)]
        warm = rag_prompt(docs, system, random_tokens(QUERY_TOKENS, rng, vocab))
        cold = ttft(engine, warm, "hypic")
        times["hypic_cold"] += [cold] if round_ else []
    ttft(engine, warm, "prefix")
    for _ in range(repeats):
        order = rng.sample(docs, len(docs))
        for mode in ("none", "prefix", "hypic"):  # a query of its own: no mode reuses another's prompt
            prompt = rag_prompt(order, system, random_tokens(QUERY_TOKENS, rng, vocab))
            times[mode].append(ttft(engine, prompt, mode))
        times["hypic_repeat"].append(ttft(engine, prompt, "hypic"))
    return {mode: statistics.median_high(t) for mode, t in times.items()}


def tuple_overhead(engine: LLMEngine, num_docs: int, doc_len: int, rng: random.Random, repeats: int) -> float:
    """Extra time of a cold segment prefill that also builds its tuple, over a plain prefill of the
    same isolated segments (both as one batch): the median over `repeats` new sets of segments, after
    an unmeasured one (kernels compile and autotune for the shape)."""
    ratios, vocab = [], engine.served_vocab_size
    for _ in range(repeats + 1):
        docs = [random_tokens(doc_len, rng, vocab) for _ in range(num_docs)]
        plain = _timed(lambda: [engine.add_request(SegmentedPrompt((d,)), SamplingParams(max_tokens=0),
                                                   cache_mode="none") for d in docs], engine)
        jobs = engine.segment_jobs(SegmentedPrompt(((0,), *docs, (0,))))
        ratios.append(_timed(lambda: engine.start_segment_jobs(jobs), engine) / plain - 1.0)
    return statistics.median_high(ratios[1:])


def _timed(submit, engine: LLMEngine) -> float:
    sync()
    start = time.perf_counter()
    submit()
    while engine.has_work():
        engine.step()
    sync()
    return time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3_5_moe")
    parser.add_argument("--model", help="a model directory (CPU smoke runs) instead of a random shape")
    parser.add_argument("--lengths", type=int_list, default=[1024, 2048, 4096], help="by length: 4 documents of each")
    parser.add_argument("--counts", type=int_list, default=[4, 8, 16], help="by count: documents of --count-len")
    parser.add_argument("--count-len", type=int, default=1024)
    parser.add_argument("--overhead", type=prompt_shape, default=(8, 2048), metavar="NxLEN",
                        help="the cold segments of the tuple overhead ('' for none)")
    parser.add_argument("--repeats", type=int, default=5)  # a median of 3 once moved a 41.7 ms warm TTFT to 46.5
    parser.add_argument("--seam-width", type=int, default=8)
    parser.add_argument("--segment-state-dtype", choices=SEGMENT_STATE_DTYPES,
                        help="storage of cached T and S0 (default: EngineConfig.segment_state_dtype's; bfloat16 "
                             "halves what each compose reads)")
    parser.add_argument("--profile", type=lambda s: [prompt_shape(x) for x in s.split(",")], default=[],
                        metavar="NxLEN,...", help="print profiles of a warm request of each prompt shape (and a "
                        "cold one of the first), e.g. 4x1024,16x1024")
    parser.add_argument("--out", type=Path, help="default: bench/results/pic_<device>_<shape>[_<dtype>].json")
    return parser.parse_args(argv)


def prompt_shape(text: str) -> tuple[int, int] | None:
    """"8x2048" -> (8, 2048); "" -> None."""
    return tuple(map(int, text.split("x"))) if text else None


def result_file(args: argparse.Namespace) -> ResultFile:
    """This run's groups, in the file of its shape and setup (refused before any weights are made if
    the file holds another setup)."""
    device = torch.cuda.get_device_name() if not args.model else "cpu"
    shape = Path(args.model).name if args.model else args.shape
    header = {"benchmark": "pic", "device": device, "shape": shape, "seam_width": args.seam_width,
              "segment_state_dtype": segment_state_dtype_name(args.segment_state_dtype, "cpu" if args.model else "cuda"),
              "count_len": args.count_len}
    args.out = args.out or result_path("pic", device_label(device), variant(shape, args.segment_state_dtype))
    requested = ([f"by_length 4x{n}" for n in args.lengths] + [f"by_count {c}x{args.count_len}" for c in args.counts]
                 + (["tuple overhead"] if args.overhead else []))
    return grouped_result(args.out, header, requested, finish=derive)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    record = result_file(args)
    engine = started_engine(lambda: engine_config(args))
    rng = random.Random(0)
    with phase("warm-up"):  # every mode once: kernels compile and autotune before anything is timed
        measure(engine, 2, min(512, *args.lengths, args.count_len), rng, 1)
    for i, (num_docs, doc_len) in enumerate(args.profile):
        profile(engine, rng, num_docs, doc_len, cold=i == 0)
    measure_groups(record, engine, args, rng)
    report(record.data)


def measure_groups(record: ResultFile, engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> None:
    """Each prompt shape's TTFTs, then the tuple overhead, each saved as soon as it is measured."""
    for kind, num_docs, doc_len in ([("by_length", 4, n) for n in args.lengths]
                                    + [("by_count", c, args.count_len) for c in args.counts]):
        name = f"{num_docs}x{doc_len}"
        with group(record, f"{kind} {name}") as saved:
            saved[(kind, name)] = figures = measure(engine, num_docs, doc_len, rng, args.repeats)
            say(row(kind, name, figures))
    if args.overhead:
        with group(record, "tuple overhead") as saved:
            saved[("tuple_overhead_fraction",)] = fraction = tuple_overhead(engine, *args.overhead, rng, args.repeats)
            saved[("tuple_overhead_prompt",)] = "x".join(map(str, args.overhead))
            say(f"tuple-building overhead: {fraction:.1%} of the cold forward")


def derive(data: dict) -> None:
    """From the merged raw figures: each shape's warm speedup over recompute, and the marginal cost of a
    segment (the slope of TTFT from the smallest to the largest count in the file)."""
    for kind in KINDS:
        data[kind] = by_number(data.get(kind, {}))
    data["speedup_hypic_over_none"] = {kind: {name: t["none"] / t["hypic"] for name, t in data[kind].items()}
                                       for kind in KINDS}
    counts = {int(name.split("x")[0]): t for name, t in data["by_count"].items()}
    if len(counts) > 1:
        low, high = min(counts), max(counts)
        for mode in ("none", "hypic"):
            data[f"marginal_ms_per_segment_{mode}"] = (counts[high][mode] - counts[low][mode]) / (high - low) * 1e3


def profile(engine: LLMEngine, rng: random.Random, num_docs: int, doc_len: int, *, cold: bool) -> None:
    """Where a (cold and a) warm num_docs x doc_len request spend their time: host ops, GPU kernels,
    and the Python lines that make the host wait for the GPU. Without `cold`, the documents are
    cached by an unmeasured request first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    vocab = engine.served_vocab_size
    system = random_tokens(SYSTEM_TOKENS, rng, vocab)
    docs = [random_tokens(doc_len, rng, vocab) for _ in range(num_docs)]
    if not cold:
        ttft(engine, rag_prompt(docs, system, random_tokens(QUERY_TOKENS, rng, vocab)), "hypic")
    for label in ("cold", "warm")[0 if cold else 1:]:
        prompt = rag_prompt(rng.sample(docs, num_docs), system, random_tokens(QUERY_TOKENS, rng, vocab))
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            elapsed = ttft(engine, prompt, "hypic")
        print(f"--- {label} hypic request, {num_docs}x{doc_len}: {elapsed * 1e3:.1f} ms")
        table = prof.key_averages()
        print(table.table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))
        print(table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
        for check in (print_sync_sites, functools.partial(print_host_time, label)):
            prompt = rag_prompt(rng.sample(docs, num_docs), system, random_tokens(QUERY_TOKENS, rng, vocab))
            if label == "cold":
                engine.flush_segments()
            check(functools.partial(ttft, engine, prompt, "hypic"))


def print_host_time(label: str, run) -> None:
    """Where a request spends its host time (cProfile): hypic functions by cumulative time, then
    any function by its own time."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.runcall(run)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats("/hypic/", 30)
    stats.sort_stats("tottime").print_stats(25)
    print(f"--- {label} hypic request, host time by function")
    print(out.getvalue())


def print_sync_sites(run) -> None:
    """Counts the host syncs of `run` by the innermost hypic line that caused them."""
    import collections
    sites = collections.Counter(sync_sites(run))
    print(f"host syncs: {sum(sites.values())}")
    for site, count in sites.most_common(25):
        print(f"{count:5d}  {site}")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    common = dict(max_num_seqs=32, seam_width=args.seam_width, segment_state_dtype=args.segment_state_dtype)
    if args.model:
        return EngineConfig(model=args.model, device="cpu", cpu_cache_bytes=2 << 30, max_num_batched_tokens=16384,
                            **common)  # max_model_len: the checkpoint's own
    config = shape_config(args.shape, 32768)
    return EngineConfig(model=str(model_dir(config)), device="cuda", state_dict=random_weights(config, 0),
                        gpu_memory_utilization=0.9, max_model_len=20480, max_num_batched_tokens=20480, **common)


def report(result: dict) -> None:
    """Every figure the file holds (this run's and earlier runs')."""
    say(f"{result['device']}  {result['shape']}  w={result['seam_width']}")
    say(f"{'prompt':>18} {'none ms':>9} {'prefix ms':>10} {'hypic ms':>9} {'cold ms':>9} {'repeat ms':>10} "
        f"{'speedup':>8}")
    for kind in KINDS:
        for name, t in result[kind].items():
            say(row(kind, name, t))
    if "marginal_ms_per_segment_hypic" in result:
        say(f"marginal cost per extra segment: hypic {result['marginal_ms_per_segment_hypic']:.2f} ms, "
            f"recompute {result['marginal_ms_per_segment_none']:.2f} ms")
    if "tuple_overhead_fraction" in result:
        say(f"tuple-building overhead: {result['tuple_overhead_fraction']:.1%} of the cold forward")


def row(kind: str, name: str, t: dict[str, float]) -> str:
    return (f"{kind:>9} {name:>8} {t['none'] * 1e3:9.1f} {t['prefix'] * 1e3:10.1f} {t['hypic'] * 1e3:9.1f} "
            f"{t['hypic_cold'] * 1e3:9.1f} {t['hypic_repeat'] * 1e3:10.1f} {t['none'] / t['hypic']:7.2f}x")


if __name__ == "__main__":
    main()
