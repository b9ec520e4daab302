"""Bytes one cached segment of 1k tokens takes in the segment pool, per released shape (CPU: the
layout alone, no weights): its T (one log-decay sum per head for the scalar family, a K x K matrix
per head for GDN), S0, conv tails and interior K/V, with tuples in the model's precision (bf16).

    python scripts/segment_bytes.py            # every shape; JSON under bench/results/
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_engine import SHAPES, parsed_config, shape_config

from hypic.cache.segment_store import SegmentLayout
from hypic.models.registry import architecture
from results import result_path, run_record


def segment_bytes(shape: str, tokens: int, dtype: torch.dtype) -> dict:
    config = shape_config(shape, 32768)
    with torch.device("meta"):
        model = architecture(config).model_cls(parsed_config(config))
    cache = model.cache_shape()
    layout = SegmentLayout.from_cache_shape(cache, dtype, dtype)
    t, s0, conv, kv = layout.block_bytes(tokens)
    return {"shape": shape, "interior_tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
            "linear_layers": len(cache.linear_layers), "full_layers": len(cache.full_layers),
            "bytes": {"T": t, "S0": s0, "conv_tails": conv, "KV": kv, "total": t + s0 + conv + kv},
            "params_b": sum(p.numel() for p in model.parameters()) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out-dir", type=Path, help="default: bench/results")
    args = parser.parse_args()
    for shape in args.shapes:
        result = {**run_record(), **segment_bytes(shape, args.tokens, torch.bfloat16)}
        b = result["bytes"]
        print(f"{shape:>18}: {b['total'] / 1e6:6.1f} MB per {args.tokens}-token segment (T {b['T'] / 1e6:.2f}, "
              f"S0 {b['S0'] / 1e6:.1f}, conv {b['conv_tails'] / 1e6:.2f}, KV {b['KV'] / 1e6:.1f} MB; "
              f"{result['linear_layers']} linear + {result['full_layers']} attention layers, "
              f"{result['params_b']:.1f} B params)")
        out = result_path("segment_bytes", "cpu", f"{shape}_{args.tokens}")
        out = args.out_dir / out.name if args.out_dir else out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
