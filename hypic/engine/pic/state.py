"""A sequence's PIC state: one object, filled and emptied by the PIC assembler, asked by the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hypic.cache.segment_store import SegmentKey
from hypic.engine.pic.pieces import Cached
from hypic.engine.pic.plan import PlannedSegment, SegmentJob
from hypic.models.batch import TupleSoFar


@dataclass
class PicState:
    """Invariant: `cached` is sorted by position, its interiors do not overlap, and every piece in
    `cached` and `covered` holds one pin of its store entry until the assembler releases it. A
    request's `planned` segments are looked up (hits pinned and promoted, misses prefilled) only
    once the scheduler is about to take it (`attached`), and given back if it stops being so."""

    planned: list[PlannedSegment] = field(default_factory=list)  # its PIC segments, from the request's plan
    attached: bool = True  # its planned segments are pieces or awaited; False: not looked up yet
    cached: list[Cached] = field(default_factory=list)  # interiors still to compose, from the segment store
    covered: list[Cached] = field(default_factory=list)  # pinned interiors a prefix hit made unnecessary
    approximate_from: int | None = None  # first position whose state comes from PIC assembly
    awaiting: set[SegmentKey] = field(default_factory=set)  # cold segments the sequence waits for
    job: SegmentJob | None = None  # set on the isolated prefill of a cold segment (no sampling)
    captured: TupleSoFar | None = None  # a job's (T, S0) over the interior its chunks computed so far
    captured_kv: list[torch.Tensor] = field(default_factory=list)  # per such chunk: [n, n_full, kv, Hkv, D] K/V rows
    on_lane: bool = False  # a job whose last chunk may still run on the cold lane (hypic.engine.pic.cold_lane)

    @property
    def blocked(self) -> bool:
        """Its segments not looked up yet, or waiting for cold segments to be prefilled or for its
        promoted entries' copies to land, before it can be assembled."""
        return not self.attached or bool(self.awaiting) or not all(p.entry.landed for p in self.cached)

    @property
    def interiors(self) -> list[tuple[int, int]]:
        """[start, end) of each interior still to compose (no chunk and no prefix hit ends inside one)."""
        return [(p.start, p.end) for p in self.cached]

    @property
    def hit_tokens(self) -> dict[str, int]:
        """Tokens of the pieces still to compose that were hits of the request's own lookups, by
        cached-token kind: "pic" from the GPU pool, "pic_host" / "pic_disk" from a lower tier."""
        hits: dict[str, int] = {}
        for p in self.cached:
            if p.from_pool:
                kind = "pic" if p.source == "pool" else f"pic_{p.source}"
                hits[kind] = hits.get(kind, 0) + p.end - p.start
        return hits

    @property
    def scattered_end(self) -> int:
        """End of the last interior: admission scatters every interior's K/V, so pages reach it."""
        return max((p.end for p in self.cached), default=0)

    def add(self, piece: Cached) -> None:
        self.cached = sorted([*self.cached, piece], key=lambda p: p.start)

    def computed_to(self, end: int) -> None:
        """Tokens [0, end) are computed: the pieces before `end` are composed."""
        self.cached = [p for p in self.cached if p.start >= end]

    def cover(self, num_tokens: int) -> None:
        """A prefix hit computed [0, num_tokens): the pieces inside it go to `covered` (to unpin)."""
        self.covered += [p for p in self.cached if p.end <= num_tokens]
        self.cached = [p for p in self.cached if p.end > num_tokens]
