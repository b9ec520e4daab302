"""Launch tiles of the Triton MoE kernels on this GPU, and the router's one-program layout against its
four-launch one, at decode- and assembly-sized batches.

Shape: Qwen3.5-35B-A3B's experts (256 of 2048 x 512, top 8, a shared expert of the routed size, fused
into the expert kernels where `routed_moe` fuses it). Each time is a CUDA-graph replay (decode and
assembly steps replay graphs) of calls cycling over LAYERS sets of weights, so that no call finds the
last one's experts in L2, as no layer of a step finds another's. For every batch: the whole
`moe_triton` call with today's tiles (`moe_tiles`), with the best gate/up tile of the grid (down as
today), then with the best down tile beside it; and, up to 16 tokens, the routing paths' times.
`--today-only` times today's tiles alone, beside the grid's figures in the same file (`today`, `grid`).

    python scripts/tune_moe.py                  # the grid, then `moe_tiles` follows it
    python scripts/tune_moe.py --today-only     # today's tiles beside the grid's figures
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from hypic.bench.report import run_record, write_json
from hypic.kernels.moe import (DECODE_MAX_PAIRS, ExpertBlocks, MoeTiles, Routing, SharedExpert, Tile, _block_rows,
                               expert_blocks_triton, moe_tiles, moe_triton, route_blocks_triton, route_topk_triton)
from results import device_label, graph_ms, int_list, result_path

EXPERTS, TOPK, HIDDEN, INTER = 256, 8, 2048, 512
LAYERS = 8  # weight sets a graph cycles over: 8 x 1.6 GB, far past the 50 MB L2
GATE_UP = [Tile(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8), (2, 3, 4))]
DOWN = [Tile(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4, 8), (2, 3))]


class Batch:
    """One batch's inputs for every layer of the cycle, laid out as `routed_moe` would."""

    def __init__(self, tokens: int, weights: list[tuple[torch.Tensor, torch.Tensor, SharedExpert]]) -> None:
        self.tokens, self.weights = tokens, weights
        self.x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.logits = [torch.randn(tokens, EXPERTS, device="cuda") for _ in weights]
        pairs = tokens * TOPK
        self.block = _block_rows(pairs, EXPERTS, torch.bfloat16)
        self.fused = pairs <= DECODE_MAX_PAIRS  # routed_moe fuses the shared expert here
        # any valid layout (the order within an expert's run moves no time)
        self.routes = [self._route(logits) for logits in self.logits]

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
        weights, ids = route_topk_triton(logits, TOPK, True)
        return weights, ids, expert_blocks_triton(ids, EXPERTS, self.block)

    def ms(self, tiles: MoeTiles) -> float:
        layers = itertools.cycle(range(len(self.weights)))

        def call():
            i = next(layers)
            w_gate_up, w_down, shared = self.weights[i]
            weights, ids, blocks = self.routes[i]
            if self.fused:
                return moe_triton(self.x, w_gate_up, w_down, weights, ids, blocks=blocks, shared_expert=shared,
                                  tiles=tiles)
            return moe_triton(self.x, w_gate_up, w_down, weights, ids, blocks=blocks, tiles=tiles)
        return graph_ms(call, calls_per_graph=2 * LAYERS, replays=10) * 1e3

    def routing(self) -> dict[str, dict[str, float]]:
        """The routing paths' times (us), where one program can route the batch."""
        if self.tokens * TOPK > DECODE_MAX_PAIRS:
            return {}
        logits, routing = self.logits[0], Routing(TOPK, True)

        def four_launches():
            _, ids = route_topk_triton(logits, TOPK, True)
            return expert_blocks_triton(ids, EXPERTS, self.block)
        return {"routing_us": {"one_program": graph_ms(lambda: route_blocks_triton(logits, routing, self.block)) * 1e3,
                               "four_launches": graph_ms(four_launches) * 1e3}}


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
    today = moe_tiles(batch.tokens * TOPK, batch.block)
    today_us = batch.ms(today)
    if not grid:
        return {"block": batch.block, "today": asdict(today), "today_us": today_us, **batch.routing()}
    up, up_us = best(batch, GATE_UP, lambda t: MoeTiles(t, today.down))
    down, both_us = best(batch, DOWN, lambda t: MoeTiles(up, t))
    figures = {"block": batch.block, "shared_fused": batch.fused, "today": asdict(today), "today_us": today_us,
               "best_gate_up": asdict(up), "with_best_gate_up_us": up_us, "best_down": asdict(down),
               "with_both_us": both_us, "speedup": today_us / both_us}
    return {**figures, **batch.routing()}


def layer_weights() -> list[tuple[torch.Tensor, torch.Tensor, SharedExpert]]:
    sets = []
    for _ in range(LAYERS):
        w_gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5
        w_down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / INTER ** 0.5
        shared = SharedExpert(w_gate_up[0].clone(), w_down[0].clone(), torch.zeros(1, 1, device="cuda"))
        sets.append((w_gate_up, w_down, shared))
    return sets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int_list, default=[1, 2, 4, 8, 10, 16, 32, 64, 128, 256])
    parser.add_argument("--today-only", action="store_true", help="time moe_tiles' tiles alone, no grid")
    parser.add_argument("--out", type=Path, help="default: bench/results/moe_tiles_<device>_qwen3_5_moe.json")
    args = parser.parse_args()
    args.out = args.out or result_path("moe_tiles", device_label(torch.cuda.get_device_name()), "qwen3_5_moe")
    torch.manual_seed(0)
    weights = layer_weights()
    kind = "today" if args.today_only else "grid"
    result = previous_result(args.out)
    result["runs"][kind] = run_record()
    for tokens in args.tokens:
        gates = [SharedExpert(s.gate_up, s.down, s.gate_logit.expand(tokens, 1)) for _, _, s in weights]
        batch = Batch(tokens, [(up, down, shared) for (up, down, _), shared in zip(weights, gates)])
        result["by_tokens"].setdefault(str(tokens), {})[kind] = figures = tune(batch, grid=not args.today_only)
        print(f"tokens {tokens}: {figures}", flush=True)
        write_json(args.out, result)  # after every batch: a killed run keeps what it measured
    return 0


def previous_result(path: Path) -> dict:
    """The file's figures of this device, where a run of the other kind left them: a grid run and a run of
    today's tiles alone (after `moe_tiles` took the grid's figures) share one file."""
    device = torch.cuda.get_device_name()
    previous = json.loads(path.read_text()) if path.exists() else {}
    if previous.get("device") != device:
        return {"benchmark": "moe_tiles", "device": device, "runs": {}, "by_tokens": {}}
    return previous


if __name__ == "__main__":
    sys.exit(main())
