"""Read a disk-only segment, or recompute it? (issue 28: the disk tier is never slower than recomputing.)

Reading an entry costs the reads already under way (the disk serves them first) and its own bytes
at the disk's overall read throughput (bytes over the wall time of concurrent reads, kept beside
the files or probed at start-up, then measured from this engine's reads: `hypic.cache.disk_tier`);
recomputing it costs the tokens already being recomputed and its own at the engine's prefill rate,
measured from its own steps. A segment is read when that is no slower, and its read gets a
deadline: the time its recompute would have taken. A read not done by then is abandoned by the
requests waiting for it, which recompute the segment instead (the read still lands, in host
memory): a slow or stalled disk costs at most one recompute time more than having no disk.

A disk directory is read by an engine restarted on it, whose first requests may be served from it
alone (steps that compose cached pieces say nothing of the prefill rate): so the prefill rate an
engine measured is kept beside the files when it closes, and the next engine starts from it.
Without one, the prefill rate is a constant that leans towards reading (slower than any GPU, the
speed of a small model on a few CPU cores), so that a fresh engine never recomputes what a disk
could have served faster; the deadlines bound what that costs when it is wrong.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from hypic.cache.disk_tier import keep_rates, kept_rates
from hypic.cache.tiers import LowerTiers
from hypic.engine.prefill_cost import StepWork

UNMEASURED_TOKENS_PER_S = 2000.0
MIN_MEASURED_TOKENS = 64  # steps with fewer prefill tokens say more about overheads than about the rate
PREFILL_RATE = "prefill_tokens_per_s"  # its key in the disk directory's rates file
_SMOOTHING = 0.2  # weight of the newest step in the running rate


class ReadOrRecompute:
    def __init__(self, read_bytes_per_s: Callable[[], float], tokens_per_s: float = UNMEASURED_TOKENS_PER_S,
                 kept: Path | None = None, reading_bytes: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`read_bytes_per_s`: the disk's overall read rate now; `reading_bytes`: the bytes of its
        reads under way; `kept`: the rates file holding the prefill rate an earlier engine measured
        (it replaces `tokens_per_s`), where `keep` writes this engine's; `clock`: what deadlines
        are times of."""
        self.read_bytes_per_s, self.reading_bytes, self.kept, self.clock = read_bytes_per_s, reading_bytes, kept, clock
        self.tokens_per_s = (kept_rates(kept).get(PREFILL_RATE) if kept is not None else None) or tokens_per_s
        self.measured = False  # by this engine's steps (the first one replaces a kept rate)
        self.recomputed = 0  # disk entries recomputed because that was cheaper
        self.late = 0  # disk reads not done by their deadline (the assembler counts them)

    @classmethod
    def for_tiers(cls, lower: LowerTiers | None) -> ReadOrRecompute:
        """The decision for an engine's disk tier (none: nothing ever to decide)."""
        if lower is None or lower.disk is None:
            return cls(lambda: math.inf)
        disk = lower.disk
        return cls(lambda: disk.read_bytes_per_s, kept=disk.rates_path, reading_bytes=lambda: lower.reading_bytes)

    def observe(self, work: StepWork, seconds: float) -> None:
        """One step's prefill tokens and wall time (the step's decode rows ride along: a rate on the low side)."""
        if work.tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        rate = work.tokens / seconds
        self.tokens_per_s = rate if not self.measured else (1 - _SMOOTHING) * self.tokens_per_s + _SMOOTHING * rate
        self.measured = True

    def read_deadline(self, nbytes: int, tokens: int, recomputing: int = 0) -> float | None:
        """The `clock` time by which a read of an entry of `nbytes` must be done, or None: recompute
        its `tokens` instead (counted in `recomputed`). `recomputing`: tokens of segments being
        recomputed already (they go first)."""
        recompute_s = (recomputing + tokens) / self.tokens_per_s
        if (self.reading_bytes() + nbytes) / self.read_bytes_per_s() > recompute_s:
            self.recomputed += 1
            return None
        return self.clock() + recompute_s

    def keep(self) -> None:
        """Write the prefill rate this engine measured to `kept`, for the next engine."""
        if self.kept is not None and self.measured:
            keep_rates(self.kept, **{PREFILL_RATE: self.tokens_per_s})


class StepObserver(Protocol):
    def observe(self, work: StepWork, seconds: float) -> None: ...


class StepClock:
    """Times steps for the cost models (`ReadOrRecompute`, `PrefillCost`) without ever waiting on
    the device: on a GPU a pair of CUDA events per step, read once the second has completed;
    elsewhere the host clock."""

    def __init__(self, device: torch.device, observers: Sequence[StepObserver]) -> None:
        self._cuda, self._observers = device.type == "cuda", tuple(observers)
        self._open: tuple[StepWork, float | torch.cuda.Event] | None = None
        self._pending: list[tuple[StepWork, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, work: StepWork | None) -> None:
        """Before a step's forward; `work` None (or without prefill tokens) for a step not worth measuring."""
        self._open = None
        if work is not None and work.tokens > 0:
            self._open = (work, self._mark())

    def stop(self) -> None:
        """After the step; hands every completed measurement to the cost models."""
        if self._open is not None:
            work, began = self._open
            if self._cuda:
                self._pending.append((work, began, self._mark()))
            else:
                self._observe(work, time.perf_counter() - began)
        marks = [(p, p[2].query()) for p in self._pending]
        self._pending = [p for p, done in marks if not done]
        for work, began, ended in [p for p, done in marks if done]:
            self._observe(work, began.elapsed_time(ended) / 1000)

    def _observe(self, work: StepWork, seconds: float) -> None:
        for observer in self._observers:
            observer.observe(work, seconds)

    def _mark(self) -> float | torch.cuda.Event:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
