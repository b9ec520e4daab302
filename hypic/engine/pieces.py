"""A prefill is an ordered list of pieces (DESIGN §3.5).

The scheduler walks the pieces in order: it chunks `Compute` pieces under the step's token budget;
the PIC assembly adds `Cached` pieces (a segment's tuple) that linear layers compose in one step.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Compute:
    """Tokens to run through the model at consecutive global positions start, start + 1, ..."""

    token_ids: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


Piece = Compute
