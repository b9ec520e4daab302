"""What a prefill chunk adds to a decode step, by its size and its context (the long-prefill cap's
cost model, issue 26 item 2), and the attention context L the engine fits from its own steps.

`--decoders` requests decode while one long prompt is prefilled; at each of `--contexts` the long
prompt is held there and the step budget set so that each step holds the decodes plus n of its
tokens, for each n of `--tokens` (0: decodes alone). Reported per (context, n): the median step time.
Then the long prompt runs to its end in 1024-token chunks and the engine's fitted L is read.

    python scripts/bench_prefill_cost.py   # -> bench/results/prefill_cost_cpu_default_model.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from results import device_label, result_path, run_record, write_json

from hypic import EngineConfig, SamplingParams
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--contexts", default="1000,6000,12000", help="(default: %(default)s)")
    parser.add_argument("--tokens", default="0,8,32,64,128", help="prefill tokens a step (default: %(default)s)")
    parser.add_argument("--decoders", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=15, help="steps a point, median taken (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="default: bench/results/prefill_cost_<device>_default_model.json")
    return parser.parse_args()


def ids(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 3000) for _ in range(count))


def median_step_ms(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def with_budget(engine: LLMEngine, tokens: int) -> None:
    """The step budget: the decodes' rows plus `tokens` of the long prompt."""
    limits = engine.scheduler.limits
    engine.scheduler.limits = dataclasses.replace(limits, max_num_batched_tokens=tokens)


def main() -> int:
    args = parse_args()
    contexts, sizes = [int(c) for c in args.contexts.split(",")], [int(n) for n in args.tokens.split(",")]
    engine = LLMEngine(EngineConfig(device=args.device, max_model_len=16384, max_num_batched_tokens=1024,
                                    cache_mode="none", long_prefill_token_threshold=0))
    rng = random.Random(0)
    for _ in range(args.decoders):
        engine.add_request(SegmentedPrompt((ids(rng, 4),)), SamplingParams(max_tokens=16000, ignore_eos=True))
    engine.step()
    rid = engine.add_request(SegmentedPrompt((ids(rng, 16000),)), SamplingParams(max_tokens=1))
    long = engine.requests[rid].completions[0].seq
    points = []
    for context in contexts:
        with_budget(engine, 1024)
        while long.num_computed < context:
            engine.step()
        for n in sizes:
            with_budget(engine, args.decoders + n)
            points.append({"context": long.num_computed, "tokens": n, "step_ms": median_step_ms(engine, args.steps)})
            print(json.dumps(points[-1]), flush=True)
    with_budget(engine, 1024)
    while not long.finished:
        engine.step()
    cost = engine.scheduler.cost
    result = {"benchmark": "prefill_cost", **run_record(), "device": str(engine.device),
              "decoders": args.decoders, "points": points,
              "fitted_attention_context": cost.attention_context, "fit_measured": cost.measured}
    device = "cpu" if engine.device.type == "cpu" else device_label(torch.cuda.get_device_name())
    write_json(args.out or result_path("prefill_cost", device, "default_model"), result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
