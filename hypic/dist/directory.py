"""Which engine node holds which segment tuple (the router's view of every node's segment store).

A hint, never the truth: a node may have evicted a tuple since. A pull that finds nothing says so
(`Progress(missing)`), the router drops that holder, and the segment is prefilled instead.
"""
from __future__ import annotations

from collections import OrderedDict

from hypic.cache.segment_store import SegmentKey


class SegmentDirectory:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._holders: OrderedDict[SegmentKey, set[int]] = OrderedDict()  # least recently used first

    def add(self, key: SegmentKey, node_id: int) -> None:
        self._holders.setdefault(key, set()).add(node_id)
        self._holders.move_to_end(key)
        while len(self._holders) > self._capacity:
            self._holders.popitem(last=False)

    def holders(self, key: SegmentKey) -> frozenset[int]:
        return frozenset(self._holders.get(key, ()))

    def drop(self, key: SegmentKey, node_id: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(node_id)
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
