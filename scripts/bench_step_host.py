"""Host time of one engine step, beside the device work it drives (issue 29).

An engine runs greedy decode steps at batch 1 and 64 and 4k-token prefill steps. Each step's wall
time is split into "device" and "host". On the CPU (the bundled model) "device" is the model
forward (`model.forward` + `compute_logits`, what a GPU runs asynchronously); on CUDA it is the time
the host waits for the GPU at the step's one read (the sampled ids; --shape picks a
bench_engine.py shape with random weights). "host" is the rest: what the step costs before and
after its kernels (or CUDA graph) run, split by stage (scheduling, building the step's tensors,
sampling, "other": mostly output processing). Medians over the steps, and the least host time of
any step, and of its build (this machine's other load only adds to them); gc is off while timing.
PYTHONPATH picks the tree measured (a `git archive` of main for "before"):

    git archive main | tar -x -C /tmp/main-tree && git rev-parse main > /tmp/main-tree/COMMIT
    PYTHONPATH=/tmp/main-tree python scripts/bench_step_host.py --label before --tree /tmp/main-tree
    PYTHONPATH=. python scripts/bench_step_host.py --label after
"""
from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import hypic
from hypic import EngineConfig, SamplingParams
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from results import before_after_arguments, device_label, result_path, write_labelled_run

DECODE_BATCHES = (1, 64)
DECODE_STEPS = 200
PREFILL_TOKENS = 4096
PREFILL_REPEATS = 12
PROMPT_TOKENS = 128  # of each decoding sequence
STAGES = ("schedule", "build", "execute", "sample")  # "execute": less the build inside it
OPTIONS = dict(max_num_seqs=max(DECODE_BATCHES), max_num_batched_tokens=PREFILL_TOKENS,
               max_model_len=PREFILL_TOKENS + 64, cache_mode="none")


class StepClock:
    """Seconds of each named stage of a step, and of the device work inside them."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.device = 0.0

    def reset(self) -> None:
        self.stages, self.device = {}, 0.0

    def wrap(self, owner: object, name: str, label: str | None = None, *, wait_first: bool = False) -> None:
        """Times owner.name under `label` (a host stage, less the device work inside it) or, label None,
        as device work: the whole call, or (wait_first) a wait for the GPU before it."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            device_before, start = self.device, time.perf_counter()
            if wait_first:
                torch.cuda.synchronize()
                self.device += time.perf_counter() - start
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                if label is None:
                    self.device += elapsed
                else:
                    self.stages[label] = self.stages.get(label, 0.0) + elapsed - (self.device - device_before)
        setattr(owner, name, timed)


def instrument(engine: LLMEngine, clock: StepClock) -> None:
    if engine.device.type == "cuda":  # the sampler's one read of the ids is where the host waits
        clock.wrap(engine.sampler, "_result", wait_first=True)
    else:
        clock.wrap(engine.model, "forward")
        clock.wrap(engine.model, "compute_logits")
    owners = {"schedule": (engine.scheduler, "schedule"), "build": (engine.runner, "_forward_batch"),
              "sample": (engine.sampler, "sample"), "execute": (engine.runner, "execute")}
    for label in STAGES:
        clock.wrap(*owners[label], label)


def timed_step(engine: LLMEngine, clock: StepClock) -> dict[str, float]:
    """Milliseconds of one step: wall, device, host, and each host stage ("execute" less "build";
    "other": the rest of the step, mostly output processing)."""
    clock.reset()
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    stages = {label: clock.stages.get(label, 0.0) for label in STAGES}  # a step may not sample
    stages["execute"] -= stages["build"]
    host = wall - clock.device
    stages["other"] = host - sum(stages.values())
    return {name: seconds * 1e3 for name, seconds in
            {"wall": wall, "device": clock.device, "host": host, **stages}.items()}


def summary_ms(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each column's median, and the least host and build time of any step (what a busy machine's
    other processes cannot inflate; medians of separate columns need not add up)."""
    return {**{name: statistics.median(s[name] for s in samples) for name in samples[0]},
            **{f"{name}_min": min(s[name] for s in samples) for name in ("host", "build")}}


def prompt(engine: LLMEngine, n: int, rng: random.Random) -> SegmentedPrompt:
    ids = [rng.randrange(3, 3000) for _ in range(n)]
    return SegmentedPrompt.build(engine.tokenizer, ids, separator=engine.config.segment_separator)


def decode_steps(engine: LLMEngine, clock: StepClock, batch: int, rng: random.Random) -> dict[str, float]:
    # room for every sequence to outlast the timed steps, however staggered the scheduler admits them
    params = SamplingParams(max_tokens=OPTIONS["max_model_len"] - PROMPT_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(prompt(engine, PROMPT_TOKENS, rng), params)
    while engine.scheduler.waiting or any(not s.in_decode for s in engine.scheduler.running):
        engine.step()
    engine.step()
    samples = [timed_step(engine, clock) for _ in range(DECODE_STEPS)]
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return summary_ms(samples)


def prefill_steps(engine: LLMEngine, clock: StepClock, rng: random.Random) -> dict[str, float]:
    """The steps of one prompt added up: the whole prompt in one chunk unless the scheduler cuts it,
    and its one sampled token."""
    samples = []
    for _ in range(PREFILL_REPEATS):
        engine.add_request(prompt(engine, PREFILL_TOKENS - 1, rng), SamplingParams(max_tokens=1, temperature=0.0))
        steps = []
        while engine.has_work():
            steps.append(timed_step(engine, clock))
        samples.append({name: sum(step[name] for step in steps) for name in steps[0]})
    return summary_ms(samples)


def without_gc(run: Callable[[], dict]) -> dict:
    gc.collect()
    gc.disable()
    try:
        return run()
    finally:
        gc.enable()


def check_tree(tree: Path) -> None:
    """The run measures the tree it is labelled with: PYTHONPATH must put that tree's hypic first."""
    source = Path(hypic.__file__).resolve().parents[1]
    if source != tree.resolve():
        raise SystemExit(f"hypic is imported from {source}, not from --tree {tree}: set PYTHONPATH={tree}")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", help="a bench_engine.py shape with random bf16 weights (CUDA; default: the bundled model)")


def build_engine(args: argparse.Namespace) -> LLMEngine:
    if args.shape is None:
        return LLMEngine(EngineConfig(**OPTIONS, device=args.device, cpu_cache_bytes=1 << 30))
    from bench_engine import model_dir, random_weights, shape_config
    config = shape_config(args.shape, OPTIONS["max_model_len"])
    return LLMEngine(EngineConfig(**OPTIONS, model=str(model_dir(config)), device=args.device,
                                  state_dict=random_weights(config, 0), gpu_memory_utilization=0.9))


def main() -> None:
    args = before_after_arguments(__doc__, None, options)
    device = "cpu" if args.device == "cpu" else device_label(torch.cuda.get_device_name())
    args.out = args.out or result_path("step_host", device, args.shape or "default_model")
    check_tree(args.tree)
    torch.set_num_threads(1)  # the CPU forward is excluded; one thread keeps the two figures apart
    engine = build_engine(args)
    clock = StepClock()
    instrument(engine, clock)
    rng = random.Random(0)
    decode_steps(engine, clock, 4, rng)  # warm-up
    results = {f"decode_batch_{b}": without_gc(lambda b=b: decode_steps(engine, clock, b, rng)) for b in DECODE_BATCHES}
    results[f"prefill_{PREFILL_TOKENS}"] = without_gc(lambda: prefill_steps(engine, clock, rng))
    report(args.label, results)
    settings = [f"{k}={v}" for k, v in OPTIONS.items()] + [f"device={args.device}", f"shape={args.shape}"]
    write_labelled_run(args, "step_host", settings, results)


def report(label: str, results: dict[str, dict[str, float]]) -> None:
    names = list(next(iter(results.values())))
    print(f"{label}: median ms per step")
    print(f"{'step':>18} " + " ".join(f"{name:>9}" for name in names))
    for step, figures in results.items():
        print(f"{step:>18} " + " ".join(f"{figures[name]:9.3f}" for name in names))


if __name__ == "__main__":
    main()
