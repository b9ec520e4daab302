"""Where the host time of constrained decoding goes, per engine step, at batch 1 and 32 with a
248,320-token vocabulary (the Qwen3.5 tokenizer's size; bench_structured's synthetic tokenizer).

The model is the bundled shape cut to a tiny forward (hidden 64, 2 layers) with that vocabulary, so
host costs dominate on the CPU; `--device cuda` runs bench_structured's released shape instead. Each
constrained-only call on the engine thread is timed by wrapping it (fill: starting the masks;
wait: blocked on the fill; apply: the mask onto the logits; advance: the matchers consuming the
sampled tokens), and so are the mask computation on the filler thread (compute) and how long a fill
waited to start there (start_delay). Steps are timed whole against the same batch unconstrained.
Wrappers add ~1 us a call. On CUDA the phases are host time: a wait near 0 means the fill was hidden.

    python scripts/profile_structured_host.py --label after   # -> bench/results/structured_host_cpu_qwen3_5_vocab.json
    git archive BASE | tar -x -C /tmp/base && echo BASE > /tmp/base/COMMIT
    PYTHONPATH=/tmp/base python scripts/profile_structured_host.py --label before   # the tree before, same harness
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_engine import parsed_config
from bench_structured import SCHEMA, gpu_engine, synthetic_tokenizer, timed_decode
from results import device_label, result_path, run_record, tree_commit, write_json

import hypic
import hypic.engine.sampler as sampler_module
import hypic.engine.structured as structured_module
from hypic import EngineConfig
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.setup import BUNDLED_MODEL
from hypic.models.random_weights import random_state_dict
from hypic.structured_outputs import StructuredOutputs

VOCAB = 248_320
_DECODING, _PENDING = structured_module.StructuredDecoding, structured_module.PendingMasks
# (owner, attribute, phase), the names of this tree and of the one before the prefetch; absent ones are skipped
HOOKS = [(_DECODING, "fill", "fill"), (_DECODING, "prefetch", "fill"), (_PENDING, "rows", "wait"),
         (_PENDING, "token_mask", "wait"), (sampler_module, "apply_token_mask", "apply"),
         (_DECODING, "advance", "advance"), (_DECODING, "_fill", "compute")]


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def install(self) -> None:
        for owner, name, phase in HOOKS:
            if name in vars(owner):
                setattr(owner, name, self._timed(getattr(owner, name), phase))

    def watch_filler(self, engine: LLMEngine) -> None:
        """start_delay: from a fill's submission to its start on the filler thread (the GIL's hand-off)."""
        filler = engine.structured._filler
        submit = filler.submit

        def timed_submit(fn, *args):
            queued = time.perf_counter()

            def run(*job_args):
                self.seconds["start_delay"] += time.perf_counter() - queued
                return fn(*job_args)
            return submit(run, *args)
        filler.submit = timed_submit

    def _timed(self, fn, phase: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        return timed


def cpu_engine() -> LLMEngine:
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    config.update(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  layer_types=["linear_attention", "full_attention"], dtype="float32")
    path = Path(tempfile.mkdtemp(prefix="hypic-structured-"))
    (path / "config.json").write_text(json.dumps(config))
    synthetic_tokenizer(path, VOCAB, seed=0)
    weights = random_state_dict(parsed_config(config), device=torch.device("cpu"), dtype=torch.float32)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", state_dict=weights, max_model_len=1024,
                                  max_num_seqs=32, cpu_cache_bytes=256 << 20, cache_mode="none"))


def step_ms(engine: LLMEngine, batch: int, steps: int, structured, timers: Timers) -> tuple[float, dict]:
    """Mean wall ms of a decode step, and of each timed phase within it."""
    seconds = timed_decode(engine, batch, steps, structured, prompt_len=16, before=timers.seconds.clear)
    return seconds / steps * 1e3, {k: v / steps * 1e3 for k, v in sorted(timers.seconds.items())}


def measure(engine: LLMEngine, args: argparse.Namespace, timers: Timers) -> dict:
    constraint = StructuredOutputs("json", json.dumps(SCHEMA))
    step_ms(engine, max(args.batches), 4, constraint, timers)  # compile the grammar, warm the caches
    out = {}
    for batch in args.batches:
        free = min(step_ms(engine, batch, args.steps, None, timers)[0] for _ in range(args.repeats))
        constrained, phases = min(step_ms(engine, batch, args.steps, constraint, timers) for _ in range(args.repeats))
        out[batch] = {"unconstrained_step_ms": free, "constrained_step_ms": constrained,
                      "overhead_ms": constrained - free, "constrained_phases_ms": phases}
        print(f"batch {batch:>3}: step {free:7.2f} ms free, {constrained:7.2f} ms constrained "
              f"({constrained - free:+.2f} ms); " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="before | after: the run's key in the result")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--shape", default="qwen3_5_moe", help="with --device cuda: bench_structured's shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.cpu_threads)  # the mask filler's thread is left the other core
    timers = Timers()
    timers.install()
    engine = cpu_engine() if args.device == "cpu" else gpu_engine(argparse.Namespace(
        shape=args.shape, seed=args.seed, batches=args.batches))
    timers.watch_filler(engine)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = args.out or result_path("structured_host", device_label(device_name),
                                  "qwen3_5_vocab" if args.device == "cpu" else args.shape)
    record = json.loads(out.read_text()) if out.exists() else {"benchmark": "structured_host", "runs": {}}
    tree = Path(hypic.__file__).resolve().parents[1]  # the tree measured: PYTHONPATH picks it
    record["runs"][args.label] = {**run_record(), "device": device_name, "hypic_tree_commit": tree_commit(tree),
                                  "vocab_size": engine.tokenizer.vocab_size, "cpu_threads": torch.get_num_threads(),
                                  "steps": measure(engine, args, timers)}
    write_json(out, record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
