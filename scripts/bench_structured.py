"""Decode tokens/s of constrained requests (a JSON schema, through llguidance) against unconstrained
ones, at batch 1 and 32, greedy, in the engine core.

GPU: random bf16 weights of a released shape (default: the Qwen3.5-35B-A3B text model) with a
synthetic byte-level tokenizer of the shape's vocabulary size (the bundled tokenizer's tokens plus
random byte strings), so that each mask covers as many tokens as the real model's would. CPU: the
bundled model and its own tokenizer. The schema is an endless array of small objects, so every
constrained step is mid-grammar (strings, integers, keys, punctuation) and no request ends early.

    python scripts/bench_structured.py --device cuda   # -> bench/results/structured_h200_qwen3_5_moe.json
    python scripts/bench_structured.py --device cpu    # -> bench/results/structured_cpu_default_model.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hypic import EngineConfig, SamplingParams
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.setup import BUNDLED_MODEL
from hypic.structured_outputs import StructuredOutputs

SCHEMA = {"type": "array", "minItems": 1_000_000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}}}
_PRINTABLE = [chr(c) for c in range(0x21, 0x7F)]  # byte-level tokens of these bytes are the characters themselves


def synthetic_tokenizer(path: Path, vocab_size: int, seed: int) -> None:
    """The bundled tokenizer.json with random byte strings appended up to vocab_size ids."""
    spec = json.loads((BUNDLED_MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, rng = spec["model"]["vocab"], random.Random(seed)
    while len(vocab) < vocab_size:
        token = rng.choice(("", "Ġ")) + "".join(rng.choices(_PRINTABLE, k=rng.randint(2, 9)))
        vocab.setdefault(token, len(vocab))
    (path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copy(BUNDLED_MODEL / "tokenizer_config.json", path / "tokenizer_config.json")


def gpu_engine(args: argparse.Namespace) -> LLMEngine:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine import model_dir, random_weights, shape_config
    config = shape_config(args.shape, 4096)
    path = model_dir(config)
    synthetic_tokenizer(path, config["vocab_size"], args.seed)
    return LLMEngine(EngineConfig(model=str(path), device="cuda", state_dict=random_weights(config, args.seed),
                                  max_model_len=1024, max_num_seqs=max(args.batches), cache_mode="none",
                                  gpu_memory_utilization=0.92))


def cpu_engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", max_model_len=1024, max_num_seqs=max(args.batches),
                                  cpu_cache_bytes=256 << 20, cache_mode="none"))


def decode_rate(engine: LLMEngine, batch: int, steps: int, structured: StructuredOutputs | None) -> float:
    """Generated tokens/s over `steps` decode steps of `batch` sequences (prefill excluded)."""
    return batch * steps / timed_decode(engine, batch, steps, structured, prompt_len=64)


def timed_decode(engine: LLMEngine, batch: int, steps: int, structured: StructuredOutputs | None, *,
                 prompt_len: int, before=lambda: None) -> float:
    """Seconds of `steps` greedy decode steps of `batch` random prompts, once all decode; `before`
    runs just before the clock starts. The requests are aborted after."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, structured=structured)
    rng = random.Random(batch)
    for _ in range(batch):
        ids = tuple(rng.randrange(3, 3000) for _ in range(prompt_len))
        engine.add_request(SegmentedPrompt((ids,)), params, cache_mode="none")
    while any(not s.in_decode for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    _sync(engine)
    before()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine)
    elapsed = time.perf_counter() - start
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return elapsed


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def measure(engine: LLMEngine, args: argparse.Namespace) -> dict:
    constraint = StructuredOutputs("json", json.dumps(SCHEMA))
    decode_rate(engine, max(args.batches), 4, constraint)  # warm-up: compile the grammar, fill the caches
    out = {}
    for batch in args.batches:
        free = max(decode_rate(engine, batch, args.steps, None) for _ in range(args.repeats))
        constrained = max(decode_rate(engine, batch, args.steps, constraint) for _ in range(args.repeats))
        out[batch] = {"unconstrained_tok_s": free, "constrained_tok_s": constrained,
                      "constrained_slowdown_per_token": free / constrained - 1}
        print(f"batch {batch:>3}: unconstrained {free:9.1f} tok/s  constrained {constrained:9.1f} tok/s  "
              f"({out[batch]['constrained_slowdown_per_token']:+.1%} per token)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default="qwen3_5_moe", choices=["qwen3_5_moe", "qwen3_5", "qwen3_next"])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads on the CPU (default: %(default)s)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.cpu_threads)  # the mask filler's thread is left the other core
    engine = gpu_engine(args) if args.device == "cuda" else cpu_engine(args)
    device = torch.cuda.get_device_name().split()[-1].lower() if args.device == "cuda" else "cpu"
    shape = args.shape if args.device == "cuda" else "default_model"
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": _commit(),
              "command": " ".join(sys.argv), "device": device, "shape": shape, "torch": torch.__version__,
              "vocab_size": engine.tokenizer.vocab_size, "cpu_threads": torch.get_num_threads(),
              "schema": SCHEMA, "decode": measure(engine, args)}
    out = args.out or Path(f"bench/results/structured_{device}_{shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
