"""What one more cached segment costs a warm hypic request at an equal number of tokens (issue 24).

Two warm RAG prompts of bench_pic.py's kind with the same total length (default 4 x 4096 and 16 x 1024:
the same keys, 12 more segments) run on one engine: the median wall time of a few requests of each,
then one under torch.profiler and one under an op counter. Each difference, divided by the extra
segments, is given per extra segment:

- device time by GPU kernel (self time; a CUDA graph's kernels included);
- host events by name (calls: aten ops, kernel and graph launches, copies);
- aten ops that move data (views excluded) by where the host dispatched them: the outermost
  hypic/kernels function on the stack, else the innermost hypic function. A CUDA graph replays its
  ops without dispatching them; on a CPU engine each kernel's torch reference dispatches its own
  (the walk's loops over pieces): a GPU runs such a kernel as one or two launches;
- the tokens the assembly step computes and the rows it runs (padded to a CUDA graph's size).

    python scripts/segment_cost.py --shape nemotron3_nano
    python scripts/segment_cost.py --model DIR   # a CPU engine on a checkpoint directory
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

import torch
from bench_pic import QUERY_TOKENS, SYSTEM_TOKENS, engine_config, rag_prompt, random_tokens, ttft
from op_count import launches_work
from results import device_label, result_path, run_record, variant, write_json
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import hypic
from hypic.config import SEGMENT_STATE_DTYPES
from hypic.engine.llm_engine import LLMEngine

HYPIC_ROOT = str(Path(hypic.__file__).parent) + "/"


class OpSources(TorchDispatchMode):
    """Counts the aten ops that move data by the hypic function that dispatched them (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_work(func):
            self.counts[_source(sys._getframe(1))] += 1
        return func(*args, **(kwargs or {}))


def _source(frame) -> str:
    hypic_frames = []
    while frame is not None:
        if frame.f_code.co_filename.startswith(HYPIC_ROOT):
            hypic_frames.append(f"{frame.f_code.co_filename[len(HYPIC_ROOT):]}:{frame.f_code.co_name}")
        frame = frame.f_back
    kernels = [name for name in hypic_frames if name.startswith("kernels/")]
    return kernels[-1] if kernels else (hypic_frames[0] if hypic_frames else "outside hypic")


class StepRows:
    """Records the tokens and the (padded) rows of each step the runner executes."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner, self.steps = engine.runner, []
        self.execute = self.runner.execute
        self.runner.execute = self._execute

    def _execute(self, batch, *args, **kwargs):
        graphs = self.runner.assembly_graphs
        padded = graphs.padded(batch.chunks) if graphs is not None and not batch.num_decodes else None
        tokens = sum(c.chunk.num_tokens for c in batch.chunks)
        self.steps.append({"tokens": tokens, "rows": tokens if padded is None else
                           sum(c.chunk.num_tokens for one in padded for c in one.chunks)})
        return self.execute(batch, *args, **kwargs)


def warm_costs(engine: LLMEngine, rows: StepRows, rng: random.Random, num_docs: int, doc_len: int,
               repeats: int) -> dict:
    """Median wall ms, profile and op sources of warm requests (documents cached first, new orders)."""
    vocab = min(engine.tokenizer.vocab_size, 3000)  # bench_pic's ids where the vocabulary has them
    system = random_tokens(SYSTEM_TOKENS, rng, vocab)
    docs = [random_tokens(doc_len, rng, vocab) for _ in range(num_docs)]

    def request() -> float:
        prompt = rag_prompt(rng.sample(docs, num_docs), system, random_tokens(QUERY_TOKENS, rng, vocab))
        return ttft(engine, prompt, "hypic")
    request()  # cold: caches the documents (and compiles the kernels of the shape)
    walls = sorted(request() for _ in range(repeats))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        request()
    rows.steps = []
    with OpSources() as sources:
        request()
    events = prof.key_averages()
    return {"wall_ms": walls[len(walls) // 2] * 1e3, "steps": list(rows.steps),
            "device_us": {e.key: e.self_device_time_total for e in events if e.self_device_time_total > 0},
            "calls": {e.key: e.count for e in events}, "ops_by_source": dict(sources.counts)}


def per_segment(low: dict, high: dict, extra: int) -> dict:
    """(high - low) / extra for every key of either, non-zero ones only, largest first."""
    diff = {key: (high.get(key, 0) - low.get(key, 0)) / extra for key in {*low, *high}}
    return dict(sorted(((k, v) for k, v in diff.items() if v), key=lambda kv: -abs(kv[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="nemotron3_nano")
    parser.add_argument("--model", help="a model directory (a CPU engine) instead of a random shape")
    parser.add_argument("--prompts", type=lambda s: [tuple(map(int, x.split("x"))) for x in s.split(",")],
                        default=[(4, 4096), (16, 1024)], metavar="NxLEN,NxLEN")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seam-width", type=int, default=8)
    parser.add_argument("--segment-state-dtype", choices=SEGMENT_STATE_DTYPES)
    parser.add_argument("--out", type=Path, help="default: bench/results/segment_cost_<device>_<shape>.json")
    args = parser.parse_args()
    engine = LLMEngine(engine_config(args))
    rows, rng = StepRows(engine), random.Random(0)
    low, high = (warm_costs(engine, rows, rng, n, length, args.repeats) for n, length in args.prompts)
    extra = args.prompts[1][0] - args.prompts[0][0]
    result = {**run_record(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "shape": Path(args.model).name if args.model else args.shape, "seam_width": args.seam_width,
              "prompts": [f"{n}x{length}" for n, length in args.prompts], "runs": [low, high],
              "per_extra_segment": {
                  "wall_ms": (high["wall_ms"] - low["wall_ms"]) / extra,
                  **{key: per_segment(low[key], high[key], extra) for key in ("device_us", "calls", "ops_by_source")}}}
    report(result)
    args.out = args.out or result_path("segment_cost", device_label(result["device"]),
                                       variant(result["shape"], args.segment_state_dtype))
    write_json(args.out, result)


def report(result: dict, rows: int = 25) -> None:
    extra = result["per_extra_segment"]
    print(f"{result['device']}  {result['shape']}  w={result['seam_width']}  {' vs '.join(result['prompts'])}")
    for name, run in zip(result["prompts"], result["runs"]):
        print(f"  {name}: warm {run['wall_ms']:.2f} ms, {sum(run['ops_by_source'].values())} ops dispatched, "
              f"steps (tokens, rows run) {[(s['tokens'], s['rows']) for s in run['steps']]}")
    print(f"per extra segment: {extra['wall_ms']:.3f} ms wall")
    for key, unit in (("device_us", "us"), ("calls", "calls"), ("ops_by_source", "ops")):
        print(f"-- {key}: {sum(extra[key].values()):+.2f} {unit} in all, by name:")
        for name, value in list(extra[key].items())[:rows]:
            print(f"{value:+10.2f}  {name[:100]}")


if __name__ == "__main__":
    main()
