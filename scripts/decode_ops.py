"""What one batch-1 decode step launches on the GPU, by part of the model, counted on the CPU (issue 29).

The step is the one a CUDA graph of DecodeGraphs replays (the model's forward and its logits, on the
graph's own batch, after the warm-up forward that precedes its capture) plus what runs around the replay (the static inputs' copies, the sampler's greedy
argmax), on meta tensors that say they are CUDA ones (op_count.cuda_step: real shapes, dtypes and the
GPU code path, no data, no GPU). Per part: aten ops that launch work with the bytes they read and write,
and Triton launches (their bytes not counted, see op_count.OpTally); per layer kind (the mixer class, the
MLP class, the layer norms) the totals over its layers and the kernels of one layer.

    python scripts/decode_ops.py --label after
    git archive <commit> | tar -x -C /tmp/before && echo <commit> > /tmp/before/COMMIT
    PYTHONPATH=/tmp/before python scripts/decode_ops.py --label before --tree /tmp/before
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
from bench_engine import SHAPES, WARM_UP_TOKENS, shape_config
from op_count import CUDA, DTYPE, OpCounter, OpTally, cuda_step, on_cuda
from results import result_path, write_labelled_run
from torch import nn

from hypic.cache.model_caches import ModelCaches
from hypic.engine.cuda_graphs import DecodeGraphs
from hypic.models.loader import FLOAT32_PARAMS
from hypic.models.registry import architecture

BLOCK_SIZE = 16
HEAD = "embedding, final norm, lm head"  # the stack's own ops, outside every layer
STEP_TOTALS = {"kernels": "kernels", "aten_ops": "ops", "triton_launches": "triton_launches",
               "bytes_read": "bytes_read", "bytes_written": "bytes_written"}  # per_step key: the parts' key


def meta_model(config: dict) -> nn.Module:
    """The shape's model on meta tensors that say CUDA, in bf16 (float32 where the loader keeps it)."""
    arch = architecture(config)
    with torch.device("meta"):
        model = arch.model_cls(arch.config_cls.from_dict(config))
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:  # a Linear without bias
                module._parameters[name] = on_cuda(p.to(torch.float32 if name in FLOAT32_PARAMS else DTYPE))
    return model.eval()


def layer_parts(model: nn.Module) -> tuple[dict[nn.Module, str], dict[str, int]]:
    """Each layer's parts (its mixer, MLP, norms: its child modules), named by their class, and how many
    layers have each kind."""
    parts, layers = {}, collections.Counter()
    for layer in model.layers:
        kinds = {child: type(child).__name__ for child in layer.children()}
        parts.update(kinds)
        layers.update(set(kinds.values()))
    return parts, dict(layers)


def attribute(counter: OpCounter, parts: dict[nn.Module, str], tallies: dict[str, OpTally]) -> None:
    """Hooks that count each part's ops into its kind's tally, the rest into HEAD's."""
    def enter(module: nn.Module, *_) -> None:
        counter.tally = tallies.setdefault(parts[module], OpTally())

    def leave(*_) -> None:
        counter.tally = tallies[HEAD]
    for module in parts:
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def decode_step(config: dict, max_len: int) -> dict[str, dict]:
    """The tallies of one batch-1 decode step, by part."""
    model = meta_model(config)
    counter, (parts, layers) = OpCounter(), layer_parts(model)
    with cuda_step(counter):
        caches = ModelCaches(model.cache_shape(), -(-max_len // BLOCK_SIZE) + 1, BLOCK_SIZE, 2, DTYPE, CUDA)
        graphs = DecodeGraphs(model, caches, max_num_seqs=1, max_blocks=-(-max_len // BLOCK_SIZE),
                              scratch_slot=1, scratch_block=0, max_kv_len=max_len)
        batch = graphs._graph_batch(1)
        graphs._forward(batch)  # DecodeGraphs' warm-up before the capture: what a kernel allocates once
        tallies = {HEAD: OpTally()}
        attribute(counter, parts, tallies)
        counter.tally = tallies[HEAD]
        logits = graphs._forward(batch)
        tallies["graph inputs"] = counter.tally = OpTally()
        graphs.graphs, graphs.logits = {1: _Replayed()}, {1: logits}  # the replay launches the forward's
        graphs.run(batch)
        tallies["sampler"] = counter.tally = OpTally()
        logits.argmax(dim=-1)  # Sampler.sample's all-greedy path: one argmax, then the host reads it
    return {kind: {"layers": layers.get(kind, 0), **tally.summary()} for kind, tally in tallies.items()}


class _Replayed:
    """The graph's replay: its kernels are the forward's, counted above."""

    def replay(self) -> None:
        pass


def report(parts: dict[str, dict]) -> dict:
    """The parts with their kernels (aten ops that launch work + Triton launches), per layer too."""
    for name, part in parts.items():
        part["kernels"] = part["ops"] + part["triton_launches"]
        if part["layers"]:
            part["kernels_per_layer"] = part["kernels"] / part["layers"]
        say_part(name, part)
    total = {key: sum(part[source] for part in parts.values()) for key, source in STEP_TOTALS.items()}
    say_part("per step", {**total, "ops": total["aten_ops"], "layers": 0})
    return {"parts": parts, "per_step": total}


def say_part(name: str, part: dict) -> None:
    per_layer = f" ({part['kernels_per_layer']:.1f} per layer of {part['layers']})" if part["layers"] else ""
    print(f"{name:30s} {part['kernels']:5d} kernels: {part['ops']:5d} aten + {part['triton_launches']:4d} triton"
          f"{per_layer:28s} {part['bytes_read'] / 1e6:9.1f} MB read {part['bytes_written'] / 1e6:8.2f} MB written")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="before | after")
    parser.add_argument("--shape", default="qwen3_5_moe", choices=SHAPES)
    parser.add_argument("--max-len", type=int, default=WARM_UP_TOKENS + 64,
                        help="the engine's max_model_len (bench_engine's for --lengths ''), the graph's KV bound")
    parser.add_argument("--tree", type=Path, default=Path("."), help="the hypic source tree measured")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.out = args.out or result_path("decode_ops", "cpu", args.shape)
    config = shape_config(args.shape, args.max_len)
    results = {"shape": args.shape, "batch": 1, "max_len": args.max_len, **report(decode_step(config, args.max_len))}
    write_labelled_run(args, "decode_ops", [], results)


if __name__ == "__main__":
    main()
