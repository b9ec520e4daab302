"""Command-line options for agents: the chat template, tool calls, reasoning, tools as segments."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hypic.engine.setup import resolve_model_dir
from hypic.errors import InvalidRequestError
from hypic.serve.reasoning import PARSERS as REASONING_PARSERS
from hypic.serve.tool_parsers import PARSERS as TOOL_PARSERS


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("agents (docs/agents.md)")
    group.add_argument("--chat-template", type=_template, metavar="FILE",
                       help="Jinja chat template that replaces the model's (e.g. one that renders tools)")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                       help="format of the model's tool calls (default: what the chat template writes)")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                       help="split the model's reasoning into reasoning_content (default: none)")
    group.add_argument("--tool-segments", action="store_true",
                       help="cache each tool definition as its own PIC segment (requests may override)")
    group.add_argument("--max-tokens-default", type=int, metavar="TOKENS",
                       help="max_tokens of a request that gives none (default: generation_config.json's "
                            "max_new_tokens, else the rest of the context)")


def agent_options(args: argparse.Namespace) -> dict[str, Any]:
    """ServerSettings fields from the options above."""
    default = args.max_tokens_default
    if default is None:
        default = _read_json(resolve_model_dir(args.model) / "generation_config.json").get("max_new_tokens")
    if default is not None and default < 0:
        raise InvalidRequestError(f"--max-tokens-default must be >= 0, got {default}")
    return dict(chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser, tool_segments=args.tool_segments, max_tokens_default=default)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):  # absent or unreadable: no default from it
        return {}


def _template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {path}: {error.strerror}") from None
