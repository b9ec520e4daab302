"""Host (Python) time of a warm hypic request, by engine stage, and its growth per cached segment.

A warm RAG prompt (system prefix + n cached documents in a new order + a new question, as in
bench_pic.py) runs end to end on a CPU engine (the bundled model's shape). Its host time is the
request's wall time less the time spent in the device work it queues: the model forward, the
logits, the interior K/V scatter, state-slot and page copies and the sampler. On a GPU that work
is queued asynchronously, so what remains is what the host spends before the step's kernels (or
CUDA graph) can run. Small index-tensor ops (e.g. the scatter's per-token offsets) run on the CPU
here and count as host time, though on a GPU they are queued kernels: an upper bound for those.
The prefix cache is full, so each request also evicts an older one's checkpoints, as on a busy
server. Prints a table and writes JSON under bench/results/. PYTHONPATH picks the tree measured:

    PYTHONPATH=. python scripts/bench_host.py --label after
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_pic import QUERY_TOKENS, SYSTEM_TOKENS, rag_prompt, random_tokens

from hypic import EngineConfig, SamplingParams
from hypic.engine.pic import assembly as pic_assembly
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.setup import BUNDLED_MODEL
from results import result_path, run_record


class HostClock:
    """Wall time of named engine stages, less the device work that runs inside them."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.device = 0.0
        self._open: list[list[float]] = []  # per open stage: [device seconds inside it]

    def reset(self) -> None:
        self.stages, self.device = {}, 0.0

    def stage(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            inside = [0.0]
            self._open.append(inside)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._open.pop()
                self.stages[name] = self.stages.get(name, 0.0) + elapsed - inside[0]
        return timed

    def device_work(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.device += elapsed
                for inside in self._open:
                    inside[0] += elapsed
        return timed


def instrument(engine: LLMEngine, clock: HostClock) -> None:
    """Wraps the engine's host stages and its device work (instance attributes, module names)."""
    stages = {"add_request": (engine, "add_request"), "schedule": (engine.scheduler, "schedule"),
              "pic.scatter": (engine.pic, "scatter"), "runner.execute": (engine.runner, "execute"),
              "after_step": (engine.scheduler, "after_step"), "pic.after_step": (engine.pic, "after_step"),
              "finish": (engine.scheduler, "finish")}
    for label, (owner, name) in stages.items():
        setattr(owner, name, clock.stage(label, getattr(owner, name)))
    for owner, name in ((engine.model, "forward"), (engine.model, "compute_logits"), (engine.caches, "copy_slot"),
                        (engine.caches, "copy_block"), (engine.sampler, "sample")):
        setattr(owner, name, clock.device_work(getattr(owner, name)))
    pic_assembly.scatter_kv = clock.device_work(pic_assembly.scatter_kv)


def run_request(engine: LLMEngine, prompt: SegmentedPrompt) -> float:
    """Wall seconds of one request, end to end (gc off: its pauses are noise here)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_mode="hypic")
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start
    finally:
        gc.enable()


def measure(engine: LLMEngine, clock: HostClock, num_docs: int, doc_len: int, repeats: int,
            rng: random.Random) -> dict[str, float]:
    """Median host ms of a warm request (its documents cached by one cold request first): in total,
    per stage, and outside the stages (sampling bookkeeping, outputs)."""
    vocab = engine.tokenizer.vocab_size
    system = random_tokens(SYSTEM_TOKENS, rng, vocab)
    docs = [random_tokens(doc_len, rng, vocab) for _ in range(num_docs)]
    run_request(engine, rag_prompt(docs, system, random_tokens(QUERY_TOKENS, rng, vocab)))
    samples: list[dict[str, float]] = []
    for _ in range(repeats):
        prompt = rag_prompt(rng.sample(docs, num_docs), system, random_tokens(QUERY_TOKENS, rng, vocab))
        clock.reset()
        host = run_request(engine, prompt) - clock.device
        samples.append({"host": host, **clock.stages, "other": host - sum(clock.stages.values())})
    return {name: statistics.median(s[name] for s in samples) * 1e3 for name in samples[0]}


def engine_for(doc_len: int, max_docs: int) -> LLMEngine:
    """A CPU engine on the bundled model, its position limit raised to fit the longest prompt."""
    path = Path(tempfile.mkdtemp(prefix="hypic-bench-host-"))
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    max_len = SYSTEM_TOKENS + max_docs * doc_len + QUERY_TOKENS + 64
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
    (path / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", cpu_cache_bytes=1 << 30, max_model_len=max_len,
                                  max_num_batched_tokens=max_len, max_num_seqs=8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--label", default="", help="what was measured (e.g. a commit), kept in the JSON")
    parser.add_argument("--out", type=Path, default=result_path("host", "cpu", "default_model"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # the model's CPU work is excluded; one thread keeps the host quiet
    engine = engine_for(args.doc_len, max(args.counts))
    clock = HostClock()
    instrument(engine, clock)
    rng = random.Random(0)
    measure(engine, clock, 2, args.doc_len, 2, rng)  # warm-up
    by_count = {f"{n}x{args.doc_len}": measure(engine, clock, n, args.doc_len, args.repeats, rng)
                for n in args.counts}
    stages = by_count[f"{args.counts[0]}x{args.doc_len}"]
    result = {**run_record(),
              "device": f"cpu ({platform.processor() or platform.machine()}), python {platform.python_version()}",
              "label": args.label, "doc_len": args.doc_len, "repeats": args.repeats, "host_ms": by_count,
              "host_ms_per_extra_segment": {  # least-squares slope over the counts
                  name: statistics.linear_regression(args.counts, [t[name] for t in by_count.values()]).slope
                  for name in stages}}
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


def report(result: dict) -> None:
    print(f"{result['device']}: host ms of a warm hypic request (median of {result['repeats']})")
    names = list(result["host_ms_per_extra_segment"])
    print(f"{'prompt':>10} " + " ".join(f"{name:>14}" for name in names))
    rows = {**result["host_ms"], "per segment": result["host_ms_per_extra_segment"]}
    for prompt, stages in rows.items():
        print(f"{prompt:>10} " + " ".join(f"{stages[name]:14.3f}" for name in names))


if __name__ == "__main__":
    main()
