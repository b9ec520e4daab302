"""Which segments of a prompt are cached position-independently, and over which interior."""
from __future__ import annotations

from dataclasses import dataclass

from hypic.cache.segment_store import SegmentKey
from hypic.engine.pic.segments import SegmentedPrompt

NAIVE_SEAM = -1  # naive tuples cover whole segments with T = I: a key space of their own


@dataclass(frozen=True)
class PicPolicy:
    mode: str  # "hypic" or "naive"
    seam_width: int
    conv_kernel: int

    def interior(self, length: int) -> tuple[int, int] | None:
        """[max(w, k-1), L - w) for hypic (DESIGN §1); the whole segment for naive; None if empty."""
        if self.mode == "naive":  # the conv tail needs k-1 inputs of the segment itself
            return (0, length) if length >= self.conv_kernel - 1 else None
        start, end = max(self.seam_width, self.conv_kernel - 1), length - self.seam_width
        return (start, end) if start < end else None

    @property
    def key_seam(self) -> int:
        return NAIVE_SEAM if self.mode == "naive" else self.seam_width


@dataclass(frozen=True)
class SegmentJob:
    """One PIC segment: prefilled alone (position 0, zero state), its tuple taken over `interior`."""

    key: SegmentKey
    token_ids: tuple[int, ...]
    interior: tuple[int, int]
    identity_T: bool  # naive: states are summed, never transformed
    tier: str | None = None  # the local store's best tier holding the key (filled in by the engine)

    @property
    def cached(self) -> bool:
        return self.tier is not None


@dataclass(frozen=True)
class PlannedSegment:
    start: int  # global position of the segment's first token
    job: SegmentJob

    @property
    def span(self) -> tuple[int, int]:
        """Global positions of the interior."""
        return self.start + self.job.interior[0], self.start + self.job.interior[1]


def plan_segments(prompt: SegmentedPrompt, policy: PicPolicy, fingerprint: str,
                  salt: str | None) -> list[PlannedSegment]:
    """The middle segments (not the prefix, not the query) that have an interior, in order."""
    planned = []
    for index in range(1, len(prompt.segments) - 1):
        tokens = prompt.segments[index]
        interior = policy.interior(len(tokens))
        if interior is None:
            continue
        key = SegmentKey.of(fingerprint, policy.key_seam, salt, prompt.segment_bytes(index))
        job = SegmentJob(key, tokens, interior, identity_T=policy.mode == "naive")
        planned.append(PlannedSegment(prompt.boundaries[index], job))
    return planned
