"""Counts of one tier of the segment pool (host or disk), as `/metrics` and `/admin/cache` show them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierStats:
    entries: int
    bytes: int
    capacity_bytes: int
    pinned: int
    hits: int
    misses: int
    promotions: int  # entries copied up into the pool from this tier
    demotions: int  # entries copied down into this tier
    evictions: int  # entries this tier dropped for room
    errors: int = 0  # failed reads or writes (each one cost a recompute, never a wrong answer)
