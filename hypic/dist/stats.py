"""What a cluster reports: per request (the paper's Fig. 14 breakdown) and for /metrics.

`ClusterStats` is an `EngineStats` (every field summed over the live nodes, so the server's gauges
need no change) with the router's own counters in `dist`. `DistRequestMetrics` is a `RequestMetrics`
with the request's `DistTimings`, set on every output of a request that went through the router.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from hypic.dist.messages import NodeCounters
from hypic.engine.llm_engine import EngineStats
from hypic.outputs import RequestMetrics

_SAME_ON_EVERY_NODE = frozenset({"block_size"})


@dataclass(frozen=True)
class DistTimings:
    """Where a request's time-to-first-token went (seconds): dispatch forward = dispatch until the
    last segment prefill finished (the parallel per-segment prefill); comm = from then until the
    last tuple was in the combine node's store (the transfer tail no prefill hid); combine = from
    then until the first token (composition, seam and query recompute, first decode)."""

    combine_node: int
    plan_s: float = 0.0
    dispatch_s: float = 0.0
    comm_s: float = 0.0
    combine_s: float = 0.0
    segments: int = 0  # distinct PIC segments of the prompt
    segments_local: int = 0  # already on the combine node
    segments_pulled: int = 0
    segments_built: int = 0  # prefilled for this request (on workers or the combine node)
    segments_remote: int = 0  # of those, on other nodes
    segments_redispatched: int = 0
    segment_errors: int = 0  # sources that reported a segment failed or missing
    segment_timeouts: int = 0  # segments past the deadline
    workers: int = 0  # distinct nodes that prefilled or shipped segments, the combine node included
    transfer_bytes: int = 0
    attempts: int = 1  # combine nodes tried


@dataclass(frozen=True)
class DistRequestMetrics(RequestMetrics):
    dist: DistTimings | None = None


@dataclass(frozen=True)
class DistStats:
    nodes_live: int = 0
    nodes_known: int = 0
    requests_local: int = 0  # routed to one node without dispatching segments
    requests_distributed: int = 0
    segments_local: int = 0
    segments_pulled: int = 0
    segments_built: int = 0
    segments_remote: int = 0
    segments_redispatched: int = 0
    node_deaths: int = 0
    node_hangs: int = 0  # heartbeats stopped for node_timeout_s
    node_restarts: int = 0
    segment_errors: int = 0  # failed or missing reports from source nodes
    segment_timeouts: int = 0
    combine_retries: int = 0  # combine nodes lost before the request's first output
    requests_resumed: int = 0  # generating nodes lost mid-stream: the request went on elsewhere
    transfer_bytes: int = 0
    plan_seconds: float = 0.0
    dispatch_seconds: float = 0.0
    comm_seconds: float = 0.0
    combine_seconds: float = 0.0
    nodes: NodeCounters = field(default_factory=NodeCounters)  # summed over live nodes


@dataclass(frozen=True)
class ClusterStats(EngineStats):
    dist: DistStats = field(default_factory=DistStats)


def merge_engine_stats(per_node: Sequence[dict[str, Any]]) -> EngineStats:
    """Sum of the nodes' EngineStats (as builtins); block_size is the same everywhere."""
    merged = _sum_dicts(per_node) if per_node else _zeros(EngineStats)
    return msgspec.convert(merged, EngineStats)


def cluster_stats(engine: EngineStats, dist: DistStats) -> ClusterStats:
    values = {f.name: getattr(engine, f.name) for f in dataclasses.fields(EngineStats)}
    return ClusterStats(**values, dist=dist)


def sum_counters(counters: Sequence[NodeCounters]) -> NodeCounters:
    if not counters:
        return NodeCounters()
    return msgspec.convert(_sum_dicts([msgspec.to_builtins(c) for c in counters]), NodeCounters)


def _sum_dicts(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name, first in items[0].items():
        if isinstance(first, dict):
            merged[name] = _sum_dicts([item[name] for item in items])
        elif isinstance(first, (int, float)) and not isinstance(first, bool) and name not in _SAME_ON_EVERY_NODE:
            merged[name] = sum(item[name] for item in items)
        else:
            merged[name] = first
    return merged


def _zeros(cls: type) -> dict[str, Any]:
    """An all-zero instance of a stats dataclass, as builtins (None for optional parts)."""
    return {name: _zero(hint) for name, hint in typing.get_type_hints(cls).items()}


def _zero(hint: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return _zeros(hint)
    return None if type(None) in typing.get_args(hint) else 0
