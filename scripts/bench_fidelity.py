"""Fidelity of the assembled running state (paper Table 4, §4.2): relative L2 and angle of the
linear-layer state after a PIC prefill against full recompute, at the first and the deepest linear
layer, for hypic and naive, with 2 and 4 segments.

Each segment count's figures are printed and written (hypic.bench.report's ResultFile) as soon as they
are measured; a run of some counts (--segments) merges into an existing file of the same setup.

    python scripts/bench_fidelity.py                       # the bundled model, on CPU
    python scripts/bench_fidelity.py --shape qwen3_5_moe   # a released shape, random weights, on GPU
"""
from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch

from hypic import EngineConfig, SamplingParams
from hypic.bench.report import ResultFile
from hypic.config import SEGMENT_STATE_DTYPES
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.setup import BUNDLED_MODEL
from hypic.models.random_weights import slow_decay
from results import (device_label, group, grouped_result, int_list, result_path, say, segment_state_dtype_name,
                     started_engine, variant)


def state_after_prefill(engine: LLMEngine, prompt: SegmentedPrompt, mode: str, layers: list[int]) -> list[torch.Tensor]:
    """Each layer's running state right after the prompt, read from the request's slot."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0), cache_mode=mode)
    seq = engine.requests[request_id].sequences[0]
    while not seq.output_ids:
        engine.step()
    states = [engine.caches.state(layer)[0][seq.slot].double().clone() for layer in layers]
    engine.abort(request_id)
    return states


def compare(state: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    rel = float((state - reference).norm() / reference.norm())
    cosine = float((state * reference).sum() / (state.norm() * reference.norm()))
    return {"rel_l2": rel, "angle_deg": math.degrees(math.acos(max(-1.0, min(1.0, cosine))))}


def measure(engine: LLMEngine, num_segments: int, segment_len: int, rng: random.Random) -> dict:
    vocab = engine.tokenizer.vocab_size
    pieces = [tuple(rng.randrange(3, vocab) for _ in range(n)) for n in [32] + [segment_len] * num_segments + [32]]
    prompt = SegmentedPrompt(tuple(pieces))
    layers = list(engine.caches.shape.linear_layers)
    layers = [layers[0], layers[-1]]
    reference = state_after_prefill(engine, prompt, "none", layers)
    result = {}
    for mode in ("hypic", "naive"):
        engine.flush_segments()
        state_after_prefill(engine, prompt, mode, layers)  # cold: builds the tuples
        warm = state_after_prefill(engine, prompt, mode, layers)
        result[mode] = {name: compare(s, r) for name, s, r in zip(("first", "deepest"), warm, reference)}
    return result


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The bundled model (or --model) on CPU, or a released shape with random bf16 weights on the GPU."""
    common = dict(seam_width=args.seam_width, segment_state_dtype=args.segment_state_dtype, max_model_len=16384,
                  max_num_batched_tokens=16384)
    if args.shape is None:
        return EngineConfig(model=args.model, device="cpu", cpu_cache_bytes=1 << 30, **common)
    from bench_engine import model_dir, random_weights, shape_config
    config = shape_config(args.shape, 32768)
    return EngineConfig(model=str(model_dir(config)), device="cuda", state_dict=random_weights(config, 0),
                        gpu_memory_utilization=0.9, **common)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--shape", default=None, help="a released shape with random weights (GPU)")
    parser.add_argument("--segments", type=int_list, default=[2, 4], help="segment counts")
    parser.add_argument("--segment-len", type=int, default=512)
    parser.add_argument("--seam-width", type=int, default=8)
    parser.add_argument("--segment-state-dtype", choices=SEGMENT_STATE_DTYPES,
                        help="storage of cached T and S0 (default: EngineConfig.segment_state_dtype's)")
    parser.add_argument("--slow-decay", action="store_true",
                        help="set every linear layer's decay slow (A_log=-4, dt_bias=-2): random weights "
                             "otherwise forget within a few tokens, which hides composition errors")
    parser.add_argument("--out", type=Path, help="default: bench/results/fidelity_<device>_<model>[_<dtype>][_slow_decay].json")
    return parser.parse_args(argv)


def result_file(args: argparse.Namespace) -> ResultFile:
    """This run's segment counts, in the file of its model and setup (refused before the engine is
    built if the file holds another setup)."""
    device = torch.cuda.get_device_name() if args.shape else "cpu"
    model = args.shape or Path(args.model or BUNDLED_MODEL).name
    header = {"benchmark": "fidelity", "device": device, "model": model, "segment_len": args.segment_len,
              "seam_width": args.seam_width, "slow_decay": args.slow_decay,
              "segment_state_dtype": segment_state_dtype_name(args.segment_state_dtype, "cuda" if args.shape else "cpu")}
    args.out = args.out or result_path("fidelity", device_label(device), variant(
        model, args.segment_state_dtype, "slow_decay" if args.slow_decay else None))
    return grouped_result(args.out, header, [f"segments {n}" for n in args.segments])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    record = result_file(args)
    engine = started_engine(lambda: engine_config(args))
    if args.slow_decay:
        slow_decay(engine.model)
    rng = random.Random(0)
    for n in args.segments:
        with group(record, f"segments {n}") as saved:
            saved[("segments", str(n))] = modes = measure(engine, n, args.segment_len, rng)
            for mode, layers in modes.items():
                say(f"{n} segments {mode:>6}: " + "  ".join(
                    f"{name} rel L2 {v['rel_l2']:.4f} angle {v['angle_deg']:.2f} deg" for name, v in layers.items()))


if __name__ == "__main__":
    main()
