"""Serve random bf16 weights of a released shape (GPU) with the bundled tokenizer: the server under
test of `hypic bench serve` on real model sizes without downloading weights.

Every `hypic serve` option applies (cache mode, pool size, batching limits, ...), e.g.

    hypic bench serve --server-command "python scripts/serve_shape.py --shape qwen3_5_moe --device cuda \
        --max-model-len 16384" --cache-modes none,prefix,hypic --preheat ...
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import model_dir, random_weights, shape_config  # noqa: E402

from hypic.serve.args import add_serve_arguments, engine_config, server_settings  # noqa: E402
from hypic.serve.server import run_logged  # noqa: E402

SHAPES = ("qwen3_5_moe", "qwen3_5", "qwen3_next")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3_5_moe", help="(default: %(default)s)")
    add_serve_arguments(parser)
    args = parser.parse_args()
    config = shape_config(args.shape, args.max_model_len or 16384)
    engine = dataclasses.replace(engine_config(args), model=str(model_dir(config)),
                                 state_dict=random_weights(config, seed=0))
    settings = dataclasses.replace(server_settings(args), served_model_name=args.served_model_name or args.shape)
    return run_logged(engine, settings, args)


if __name__ == "__main__":
    sys.exit(main())
