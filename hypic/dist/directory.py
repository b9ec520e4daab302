"""Which engine node holds which segment tuple, and in which tier (the router's view of every node's
segment store: GPU pool, host memory, disk).

A hint, never the truth: a node may have evicted a tuple since. Nodes report the keys whose best
tier changed (`TierMoves`, at heartbeat pace); a pull that finds nothing says so
(`Progress(missing)`), the router drops that holder, and the segment is prefilled instead.
"""
from __future__ import annotations

from collections import OrderedDict

from hypic.cache.segment_store import SegmentKey

TIERS = ("pool", "host", "disk")  # best first: a pull from a pool beats one from host memory beats disk


class SegmentDirectory:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._holders: OrderedDict[SegmentKey, dict[int, str]] = OrderedDict()  # node -> tier; LRU first

    def add(self, key: SegmentKey, node_id: int, tier: str = "pool") -> None:
        if tier not in TIERS:
            raise ValueError(f"segment tier {tier!r} is none of {TIERS}")
        self._holders.setdefault(key, {})[node_id] = tier
        self._holders.move_to_end(key)
        while len(self._holders) > self._capacity:
            self._holders.popitem(last=False)

    def holders(self, key: SegmentKey) -> frozenset[int]:
        return frozenset(self._holders.get(key, ()))

    def tier(self, key: SegmentKey, node_id: int) -> str | None:
        return self._holders.get(key, {}).get(node_id)

    def held(self, node_id: int) -> dict[SegmentKey, str]:
        """Every key the node holds, with its tier there."""
        return {key: holders[node_id] for key, holders in self._holders.items() if node_id in holders}

    def rank(self, key: SegmentKey, node_id: int) -> int:
        """0 for a pool holder, 1 for host memory, 2 for disk; len(TIERS) for a non-holder."""
        tier = self.tier(key, node_id)
        return TIERS.index(tier) if tier is not None else len(TIERS)

    def moved(self, node_id: int, moves: dict[SegmentKey, str | None]) -> None:
        """A node's report of keys whose best tier changed (None: it holds the key no more)."""
        for key, tier in moves.items():
            if tier is None:
                self.drop(key, node_id)
            else:
                self.add(key, node_id, tier)

    def drop(self, key: SegmentKey, node_id: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.pop(node_id, None)
            if not holders:
                del self._holders[key]

    def forget_salt(self, salt: str | None) -> None:
        """Entries of one salt (or all, for None) were flushed everywhere."""
        for key in [k for k in self._holders if salt is None or k.salt == salt]:
            del self._holders[key]

    def forget_node(self, node_id: int) -> None:
        """The node died or restarted: its store is gone."""
        for key in [k for k, holders in self._holders.items() if node_id in holders]:
            self.drop(key, node_id)

    def __len__(self) -> int:
        return len(self._holders)
