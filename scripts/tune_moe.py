"""Launch tiles of the Triton MoE kernels on this GPU, and the router's one-program layout against its
four-launch one, at decode- and assembly-sized batches.

Shapes (`--shape`): Qwen3.5-35B-A3B's experts (256 of 2048 x 512, top 8, a shared expert of the routed
size, fused into the expert kernels where `routed_moe` fuses it), Nemotron 3 Nano's (128 relu^2 experts
of 2688 x 1856, top 6) and Kimi-Linear-48B's (256 of 2304 x 1024, top 8); the last two run their shared
experts apart. Each time is a CUDA-graph replay (decode and assembly steps replay graphs) of calls
cycling over LAYERS sets of weights, so that no call finds the last one's experts in L2, as no layer
of a step finds another's. For every batch: the whole
`moe_triton` call with today's tiles (`moe_tiles`), with the best gate/up tile of the grid (down as
today), then with the best down tile beside it; and, up to 16 tokens, the routing paths' times.
`--today-only` times today's tiles alone, beside the grid's figures in the same file (`today`, `grid`).

    python scripts/tune_moe.py [--shape nemotron3_nano]   # the grid, then `moe_tiles` follows it
    python scripts/tune_moe.py --today-only               # today's tiles beside the grid's figures
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hypic.bench.report import run_record, write_json
from hypic.kernels.moe import (DECODE_MAX_PAIRS, ExpertBlocks, MoeTiles, Routing, SharedExpert, Tile, _block_rows,
                               expert_blocks_triton, moe_tiles, moe_triton, route_blocks_triton, route_topk_triton)
from results import device_label, graph_ms, int_list, result_path

LAYERS = 8  # weight sets a graph cycles over (Qwen3.5: 8 x 1.6 GB), far past the 50 MB L2
GATE_UP = [Tile(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8), (2, 3, 4))]
DOWN = [Tile(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4, 8), (2, 3))]


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str  # "silu" (gated) or "relu2"
    fused_shared: bool  # a SwiGLU shared expert of the routed size, inside the kernels on decode (Qwen)


SHAPES = {"qwen3_5_moe": MoeShape(256, 8, 2048, 512, "silu", True),
          "nemotron3_nano": MoeShape(128, 6, 2688, 1856, "relu2", False),
          "kimi_linear_48b": MoeShape(256, 8, 2304, 1024, "silu", False)}


class Batch:
    """One batch's inputs for every layer of the cycle, laid out as `routed_moe` would."""

    def __init__(self, shape: MoeShape, tokens: int, weights: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.shape, self.tokens, self.weights = shape, tokens, weights
        self.x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
        self.logits = [torch.randn(tokens, shape.experts, device="cuda") for _ in weights]
        pairs = tokens * shape.top_k
        self.block = _block_rows(pairs, shape.experts, torch.bfloat16)
        self.fused = shape.fused_shared and pairs <= DECODE_MAX_PAIRS  # routed_moe fuses the shared expert here
        # any valid layout (the order within an expert's run moves no time)
        self.routes = [self._route(logits) for logits in self.logits]

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
        weights, ids = route_topk_triton(logits, self.shape.top_k, True)
        return weights, ids, expert_blocks_triton(ids, self.shape.experts, self.block)

    def _shared(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> SharedExpert | None:
        """Expert 0's weights as the shared expert, where it fuses (its gate logits zero)."""
        if not self.fused:
            return None
        return SharedExpert(w_gate_up[0], w_down[0], torch.zeros(self.tokens, 1, device="cuda"))

    def ms(self, tiles: MoeTiles) -> float:
        layers = itertools.cycle(range(len(self.weights)))
        shared = [self._shared(*w) for w in self.weights]

        def call():
            i = next(layers)
            weights, ids, blocks = self.routes[i]
            return moe_triton(self.x, *self.weights[i], weights, ids, blocks=blocks, shared_expert=shared[i],
                              activation=self.shape.activation, tiles=tiles)
        return graph_ms(call, calls_per_graph=2 * LAYERS, replays=10) * 1e3

    def routing(self) -> dict[str, dict[str, float]]:
        """The routing paths' times (us; softmax), where one program can route the batch."""
        if self.tokens * self.shape.top_k > DECODE_MAX_PAIRS:
            return {}
        logits, routing = self.logits[0], Routing(self.shape.top_k, True)
        one_program = graph_ms(lambda: route_blocks_triton(logits, routing, self.block))
        return {"routing_us": {"one_program": one_program * 1e3,
                               "four_launches": graph_ms(lambda: self._route(logits)) * 1e3}}


def best(batch: Batch, grid: list[Tile], tiles_of) -> tuple[Tile, float]:
    timed = []
    for tile in grid:
        try:
            timed.append((batch.ms(tiles_of(tile)), tile))
        except Exception as e:  # a tile past the shared memory or registers: not a candidate
            print(f"  skipped {tile}: {type(e).__name__}", flush=True)
    us, tile = min(timed, key=lambda t: t[0])
    return tile, us


def tune(batch: Batch, grid: bool) -> dict:
    today = moe_tiles(batch.tokens * batch.shape.top_k, batch.block)
    today_us = batch.ms(today)
    figures = {"block": batch.block, "today": asdict(today), "today_us": today_us, **batch.routing()}
    if not grid:
        return figures
    up, up_us = best(batch, GATE_UP, lambda t: MoeTiles(t, today.down))
    down, both_us = best(batch, DOWN, lambda t: MoeTiles(up, t))
    return {**figures, "shared_fused": batch.fused, "best_gate_up": asdict(up), "with_best_gate_up_us": up_us,
            "best_down": asdict(down), "with_both_us": both_us, "speedup": today_us / both_us}


def layer_weights(shape: MoeShape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = 2 * shape.inter if shape.activation == "silu" else shape.inter

    def weight(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, device="cuda", dtype=torch.bfloat16) / dims[-1] ** 0.5
    return [(weight(shape.experts, rows, shape.hidden), weight(shape.experts, shape.hidden, shape.inter))
            for _ in range(LAYERS)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3_5_moe")
    parser.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 10, 16, 32, 64, 128, 256])
    parser.add_argument("--today-only", action="store_true", help="time moe_tiles' tiles alone, no grid")
    parser.add_argument("--out", type=Path, help="default: bench/results/moe_tiles_<device>_<shape>.json")
    args = parser.parse_args()
    args.out = args.out or result_path("moe_tiles", device_label(torch.cuda.get_device_name()), args.shape)
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    weights = layer_weights(shape)
    kind = "today" if args.today_only else "grid"
    result = previous_result(args.out, args.shape)
    result["runs"][kind] = run_record()
    for tokens in args.tokens:
        batch = Batch(shape, tokens, weights)
        result["by_tokens"].setdefault(str(tokens), {})[kind] = figures = tune(batch, grid=not args.today_only)
        print(f"tokens {tokens}: {figures}", flush=True)
        write_json(args.out, result)  # after every batch: a killed run keeps what it measured
    return 0


def previous_result(path: Path, shape: str) -> dict:
    """The file's figures of this device and shape, where a run of the other kind left them: a grid run
    and a run of today's tiles alone (after `moe_tiles` took the grid's figures) share one file."""
    device = torch.cuda.get_device_name()
    previous = json.loads(path.read_text()) if path.exists() else {}
    if previous.get("device") != device or previous.get("shape", "qwen3_5_moe") != shape:
        return {"benchmark": "moe_tiles", "device": device, "shape": shape, "runs": {}, "by_tokens": {}}
    return previous


if __name__ == "__main__":
    sys.exit(main())
