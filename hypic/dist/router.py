"""Placement decisions of the router (paper §4.4, Fig. 9): which node combines a request, and where
each of its PIC segments comes from.

A segment the combine node holds costs nothing (in any tier: its engine promotes it); one another
node holds is pulled from the holder with the best tier (GPU pool, then host memory, then disk); a cold
one is prefilled — the cold set spread Longest-Processing-Time-first over the live nodes, the
combine node included, from each node's current load. Pure logic over snapshots of node loads: the
cluster and the per-request dispatch (`dispatch.py`) act on what it returns.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hypic.cache.segment_store import SegmentKey
from hypic.dist.affinity import AffinityMap
from hypic.dist.config import DistConfig
from hypic.dist.directory import SegmentDirectory
from hypic.dist.lpt import lpt_assign
from hypic.engine.pic.plan import SegmentJob


@dataclass(frozen=True)
class NodeLoad:
    node_id: int
    pending_tokens: int  # prefill tokens queued on it: dispatched segments + prompts not yet started
    running: int  # requests it is generating for


@dataclass(frozen=True)
class Placement:
    segment: SegmentJob
    kind: Literal["local", "build", "pull"]  # local: the combine node holds it already
    source: int  # node that prefills it (build) or ships it (pull); the combine node when local


class Router:
    def __init__(self, config: DistConfig) -> None:
        self.config = config
        self.directory = SegmentDirectory(config.directory_entries)
        self.affinity = AffinityMap(config.affinity_entries)

    def load(self, node: NodeLoad) -> int:
        return node.pending_tokens + self.config.decode_token_weight * node.running

    def least_loaded(self, nodes: Sequence[NodeLoad]) -> int:
        return min(nodes, key=lambda n: (self.load(n), n.node_id)).node_id

    def choose_combine(self, nodes: Sequence[NodeLoad], segments: Sequence[SegmentJob],
                       prefix_hashes: Sequence[int]) -> int:
        """The conversation's previous node, else the one holding most of the segments' tokens,
        among nodes within `combine_load_slack_tokens` of the least loaded; ties: least loaded."""
        floor = min(self.load(n) for n in nodes)
        fit = [n for n in nodes if self.load(n) <= floor + self.config.combine_load_slack_tokens]
        previous = self.affinity.lookup(prefix_hashes)
        if previous is not None and any(n.node_id == previous for n in fit):
            return previous
        held = {n.node_id: self._held_tokens(n.node_id, segments) for n in fit}
        return min(fit, key=lambda n: (-held[n.node_id], self.load(n), n.node_id)).node_id

    def place(self, segments: Sequence[SegmentJob], combine: int, nodes: Sequence[NodeLoad]) -> list[Placement]:
        """Where each segment comes from; `nodes` are the usable ones (the combine node among them).
        Builds are listed per source largest first: the order a worker prefills them in."""
        usable = {n.node_id: n for n in nodes}
        placements, cold = [], []
        for segment in _unique(segments):
            holders = self.directory.holders(segment.key) & usable.keys()
            if combine in holders:
                placements.append(Placement(segment, "local", combine))
            elif holders:
                rank = self.directory.rank  # the best tier first, then the least loaded holder
                source = min(holders, key=lambda h: (rank(segment.key, h), self.load(usable[h]), h))
                placements.append(Placement(segment, "pull", source))
            else:
                cold.append(segment)
        return placements + self._assign_cold(cold, combine, nodes)

    def _assign_cold(self, cold: list[SegmentJob], combine: int, nodes: Sequence[NodeLoad]) -> list[Placement]:
        small = [s for s in cold if len(s.token_ids) < self.config.min_remote_tokens]
        large = [s for s in cold if len(s.token_ids) >= self.config.min_remote_tokens]
        placements = [Placement(s, "build", combine) for s in small]
        if self.config.assignment == "round_robin":
            return placements + [Placement(s, "build", nodes[i % len(nodes)].node_id) for i, s in enumerate(large)]
        start = [self.load(n) + (sum(len(s.token_ids) for s in small) if n.node_id == combine else 0) for n in nodes]
        assignment = lpt_assign([len(s.token_ids) for s in large], len(nodes), start)
        for i in assignment.order:
            placements.append(Placement(large[i], "build", nodes[assignment.owner[i]].node_id))
        return placements

    def _held_tokens(self, node_id: int, segments: Sequence[SegmentJob]) -> int:
        return sum(len(s.token_ids) for s in segments if node_id in self.directory.holders(s.key))


def _unique(segments: Sequence[SegmentJob]) -> list[SegmentJob]:
    """A document repeated in one prompt is fetched once."""
    seen: dict[SegmentKey, SegmentJob] = {}
    for segment in segments:
        seen.setdefault(segment.key, segment)
    return list(seen.values())
