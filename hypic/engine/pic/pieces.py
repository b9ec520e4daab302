"""A prefill is an ordered list of pieces (DESIGN §3.5): `Compute` tokens and `Cached` interiors.

A sequence keeps its `Cached` pieces (sorted, non-overlapping interiors); every other position of
its tokens is computed. Each step the scheduler cuts the next `Chunk` off that walk: the tokens to
run (at their global positions) and the cached pieces composed between them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TAIL_WALK_MAX = 256  # tokens after the last cached piece that are still walked token by token


@dataclass(frozen=True)
class Cached:
    """A PIC segment's interior served from the segment store: positions [start, end)."""

    start: int
    end: int
    entry: Any  # the pinned hypic.cache.segment_store.SegmentEntry
    from_pool: bool  # a hit of the request (counted in cached_tokens), not prefilled cold for it
    source: str = "pool"  # the tier the hit came from: "pool", "host" or "disk"


@dataclass(frozen=True)
class Chunk:
    """One step's share of a sequence: positions [start, end), computed tokens and composed pieces."""

    start: int
    end: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]  # global position of each token (KV index == position)
    cached: tuple[tuple[int, Cached], ...] = ()  # (tokens of this chunk before it, piece)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def cut_chunk(token_ids: list[int], start: int, limit: int, budget: int,
              cached: list[Cached]) -> Chunk:
    """Walk from `start` to at most `limit`, taking at most `budget` tokens; cached pieces met on the
    way (even at the very end) are composed, so no chunk ends inside an interior."""
    pieces = iter(p for p in cached if p.start >= start)
    piece, pos = next(pieces, None), start
    tokens: list[int] = []
    positions: list[int] = []
    composed: list[tuple[int, Cached]] = []
    while pos < limit:
        if piece is not None and piece.start == pos:
            composed.append((len(tokens), piece))
            pos, piece = piece.end, next(pieces, None)
            continue
        room = budget - len(tokens)
        if room <= 0:
            break
        stop = min(limit, pos + room, piece.start if piece is not None else limit)
        tokens += token_ids[pos:stop]
        positions += range(pos, stop)
        pos = stop
    return Chunk(start, pos, tuple(tokens), tuple(positions), tuple(composed))


def walk_length(chunk: Chunk) -> int:
    """Tokens of an assembling chunk walked token by token. A long tail after the last piece goes
    to the chunked kernel instead; a short one stays in the walk, which costs less than the chunked
    kernel's fixed per-call overhead. A walked chunk that composes nothing walks all its tokens."""
    if not chunk.cached:
        return chunk.num_tokens
    last_piece = chunk.cached[-1][0]
    return last_piece if chunk.num_tokens - last_piece > TAIL_WALK_MAX else chunk.num_tokens
