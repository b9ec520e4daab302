"""The `hypic` command: `hypic serve [options]` (same options as `python -m hypic.serve`), `hypic demo`,
`hypic bench serve [options]` (load generation against any OpenAI-compatible server) and `hypic bench plot`."""
from __future__ import annotations

import argparse
import asyncio
import sys

from hypic import __version__
from hypic.bench.serve import __doc__ as bench_serve_doc
from hypic.bench.serve import add_bench_arguments, add_plot_arguments, plot_from_args
from hypic.bench.serve import run_from_args as run_bench
from hypic.demo import DESCRIPTION as DEMO_DESCRIPTION
from hypic.demo import run_demo
from hypic.serve.args import add_serve_arguments
from hypic.serve.server import DESCRIPTION, run_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypic", description="hypic: serving hybrid-attention LLMs.")
    parser.add_argument("--version", action="version", version=f"hypic {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server", description=DESCRIPTION)
    add_serve_arguments(serve)
    _add_demo(commands)
    _add_bench(commands)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return asyncio.run(run_demo(args.device))
    if args.command == "bench":
        return plot_from_args(args) if args.benchmark == "plot" else run_bench(args, sys.argv[1:] if argv is None else argv)
    return run_from_args(serve, args)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="one question to the bundled model, cold then warm",
                               description=DEMO_DESCRIPTION)
    demo.add_argument("--device", default="auto", help="auto (default), cpu or cuda")


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True,
                                                                             metavar="BENCHMARK")
    bench_serve = bench.add_parser("serve", help="RAG / chat / traced load against an OpenAI-compatible server",
                                   description=bench_serve_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(bench_serve)
    add_plot_arguments(bench.add_parser("plot", help="one figure from several hypic bench serve results"))


if __name__ == "__main__":
    sys.exit(main())
