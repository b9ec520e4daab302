"""The `hypic` command: `hypic serve [options]` (same options as `python -m hypic.serve`)."""
from __future__ import annotations

import argparse

from hypic import __version__
from hypic.serve.args import add_serve_arguments
from hypic.serve.server import DESCRIPTION, run_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypic", description="hypic: serving hybrid-attention LLMs.")
    parser.add_argument("--version", action="version", version=f"hypic {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server", description=DESCRIPTION)
    add_serve_arguments(serve)
    args = parser.parse_args(argv)
    return run_from_args(serve, args)
