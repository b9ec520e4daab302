"""Tool definitions as PIC segments (`--tool-segments`, or `tool_segments` per request).

The rendered prompt becomes [prefix, tool 1, ..., tool n, rest]: each tool's definition is its own
segment, so requests carrying different subsets and orders of one tool set reuse every definition
from the segment pool, as documents are. This needs a template that renders the tools one after
another: rendering them one by one and all together must give the same prefix, the tool texts
concatenated, and the same suffix. That is checked at start-up on probe tools and again on each
request's tools; where it fails the prompt stays one text (exact, as without the option).
"""
from __future__ import annotations

from collections.abc import Callable
from os.path import commonprefix
from typing import Any

from hypic.errors import InvalidRequestError

Render = Callable[[list[dict[str, Any]]], str]  # the conversation rendered with these tools
_PROBES = [{"type": "function", "function": {"name": name, "description": f"Probe {name}.",
                                             "parameters": {"type": "object", "properties": {name: {"type": "string"}}}}}
           for name in ("alpha", "beta", "gamma")]


def template_qualifies(render: Render) -> bool:
    """Whether the template renders tools one after another (probe tools)."""
    try:
        return tool_segments(render, _PROBES, render(_PROBES)) is not None
    except InvalidRequestError:  # the template refuses tools
        return False


def tool_segments(render: Render, tools: list[dict[str, Any]], whole: str) -> list[str] | None:
    """[prefix, tool texts..., suffix] joining to `whole` (the render with all tools); None when the
    template does not render these tools one after another."""
    if len(tools) < 2:  # one tool's text cannot be told from the prefix and suffix around it
        return None
    singles = [render([tool]) for tool in tools]
    # whole = P + t1 + ... + tn + S and single i = P + ti + S: the lengths give len(P) + len(S)
    shared, uneven = divmod(sum(map(len, singles)) - len(whole), len(tools) - 1)
    if uneven or shared < 0:
        return None
    longest_prefix = len(commonprefix(singles))
    longest_suffix = len(commonprefix([single[::-1] for single in singles]))
    # Tool texts share their first characters ('\n{"type": ...'), which the common prefix swallows:
    # step back until the pieces add up to the whole.
    for start in range(min(longest_prefix, shared), max(shared - longest_suffix, 0) - 1, -1):
        pieces = [single[start: len(single) - (shared - start)] for single in singles]
        head, tail = singles[0][:start], singles[0][len(singles[0]) - (shared - start):]
        if whole == head + "".join(pieces) + tail:
            return [head, *pieces, tail]
    return None


def prompt_segments(wanted: bool, render: Render, tools: list[dict[str, Any]] | None, whole: str) -> str | list[str]:
    """The prompt for the engine: with tool segments wanted and possible, one segment per tool."""
    if not wanted or not tools:
        return whole
    return tool_segments(render, tools, whole) or whole
