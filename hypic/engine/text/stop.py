"""Stop strings on a streamed text: emit only text that can no longer turn into a stop string.

The sequence stops at the stop string that *ends* first in the text (on a tie, the one that starts
first). This depends only on the text, never on how it was cut into deltas. Without
include_stop_str_in_output, any tail that is the beginning of a stop string is held back until
the next text decides it; with it, nothing needs holding (a match ends the text right after the
stop string, which is emitted whole).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to emit now
    stop_str: str | None = None  # the stop string that ended the sequence, if one did

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


class StopStringMatcher:
    """Feed text deltas with `push`; when the sequence ends another way, `flush` releases held text."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(stops)
        self._include = include_stop_str_in_output
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1  # a match can start this far back
        self._window = ""  # last text seen: [already emitted | held]; holds no complete stop string
        self._emitted = 0  # chars of the window already emitted
        self._stop_str: str | None = None

    def push(self, text: str) -> StopCheck:
        if self._stop_str is not None:
            return StopCheck("", self._stop_str)
        if not self._stops:
            return StopCheck(text)
        window = self._window + text
        match = _first_match(window, self._stops)
        if match is not None:
            start, stop_str = match
            self._stop_str = stop_str
            end = start + len(stop_str) if self._include else start
            return StopCheck(window[self._emitted:end], stop_str)
        return StopCheck(self._release(window))

    def flush(self) -> str:
        held = self._window[self._emitted:]
        self._emitted = len(self._window)
        return held

    def _release(self, window: str) -> str:
        cut = len(window) if self._include else len(window) - _partial_match_len(window, self._stops)
        emitted_text = window[self._emitted:cut]
        keep_from = min(cut, max(0, len(window) - self._tail_len))  # keep held text + enough to see a match
        self._window, self._emitted = window[keep_from:], cut - keep_from
        return emitted_text


def _first_match(window: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string ending first, the longest on a tie; None if none occurs."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = window.find(stop)  # a stop's first occurrence is also the one ending first
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


def _partial_match_len(window: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `window` that is a proper beginning of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(window)), longest, -1):
            if window.endswith(stop[:k]):
                longest = k
                break
    return longest
