"""Conversation affinity: the next turn of a conversation goes to the node that served the last one,
whose private prefix cache holds its state.

A prompt is summarised by the chain hashes of its whole `granularity`-token blocks (salted, so
tenants never share). After a request finishes, the hash of its last whole block maps to its node;
the next turn's prompt extends that prompt, so one of its block hashes is that same hash.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash


def prefix_hashes(token_ids: Sequence[int], salt: str | None, granularity: int) -> list[int]:
    """Chain hashes of token_ids[:g], token_ids[:2g], ... (whole blocks only)."""
    h = xxhash.xxh64(f"{salt!r}".encode()).intdigest()
    hashes = []
    for end in range(granularity, len(token_ids) + 1, granularity):
        block = xxhash.xxh64(h.to_bytes(8, "little"))
        block.update(array("q", token_ids[end - granularity: end]).tobytes())
        h = block.intdigest()
        hashes.append(h)
    return hashes


class AffinityMap:
    """Prefix hash -> node id, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._nodes: OrderedDict[int, int] = OrderedDict()

    def remember(self, hashes: Sequence[int], node_id: int) -> None:
        if not hashes:
            return
        self._nodes[hashes[-1]] = node_id
        self._nodes.move_to_end(hashes[-1])
        while len(self._nodes) > self._capacity:
            self._nodes.popitem(last=False)

    def lookup(self, hashes: Sequence[int]) -> int | None:
        """The node of the longest remembered prefix, or None."""
        for h in reversed(hashes):
            node_id = self._nodes.get(h)
            if node_id is not None:
                self._nodes.move_to_end(h)
                return node_id
        return None

    def forget_node(self, node_id: int) -> None:
        """A node that restarted lost its prefix cache."""
        for h in [h for h, n in self._nodes.items() if n == node_id]:
            del self._nodes[h]
