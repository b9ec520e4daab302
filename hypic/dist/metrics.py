"""Prometheus view of a cluster's `DistStats` (hypic_dist_*), read from the stats at scrape time.

Register next to the server's own collector when the engine client is distributed:
    registry.register(DistCollector(client.stats))
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_GAUGES = frozenset({"nodes_live", "nodes_known", "pending_receives", "pending_receive_bytes", "active_segment_jobs"})


class DistCollector(Collector):
    def __init__(self, stats: Callable[[], object]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        dist = getattr(self._stats(), "dist", None)
        if dist is None:
            return
        yield from _families("hypic_dist_", dist)
        yield from _families("hypic_dist_node_", dist.nodes)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _families(prefix: str, stats: object) -> Iterator[Metric]:
    """Every number of a stats dataclass or Struct (nested ones are skipped)."""
    for field, value in msgspec.to_builtins(stats).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if field in _GAUGES:
            yield GaugeMetricFamily(prefix + field, f"Segment parallelism: {field}", value=float(value))
        else:
            yield CounterMetricFamily(prefix + field, f"Segment parallelism: {field} (total)", value=float(value))
