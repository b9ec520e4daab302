"""Read a disk-only segment, or recompute it? (issue 28: short segments and slow disks recompute.)

Reading costs the entry's bytes over the disk's read rate (measured at start-up, then from every
read: `hypic.cache.disk_tier`); recomputing costs the segment's tokens over the engine's prefill
rate, measured from its own steps. A disk directory is read by an engine restarted on it, whose
first requests may be served from it alone (steps that compose cached pieces say nothing of the
prefill rate): so the rate an engine measured is kept beside the files when it closes, and the
next engine starts from it. Without one, the prefill rate is a constant that leans towards
reading (slower than any GPU, the speed of a small model on a few CPU cores), so that a fresh
engine never recomputes what a disk could have served faster.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from hypic.cache.disk_tier import DiskTier
from hypic.engine.prefill_cost import StepWork

UNMEASURED_TOKENS_PER_S = 2000.0
MIN_MEASURED_TOKENS = 64  # steps with fewer prefill tokens say more about overheads than about the rate
_SMOOTHING = 0.2  # weight of the newest step in the running rate


class ReadOrRecompute:
    def __init__(self, read_bytes_per_s: Callable[[], float], tokens_per_s: float = UNMEASURED_TOKENS_PER_S,
                 kept: Path | None = None) -> None:
        """`read_bytes_per_s`: the disk's read rate now; `kept`: the file holding the prefill rate an
        earlier engine measured (it replaces `tokens_per_s`), where `keep` writes this engine's."""
        self.read_bytes_per_s, self.kept = read_bytes_per_s, kept
        self.tokens_per_s = _kept_rate(kept) or tokens_per_s
        self.measured = False  # by this engine's steps (the first one replaces a kept rate)
        self.recomputed = 0  # disk entries recomputed because that was cheaper

    @classmethod
    def for_disk(cls, disk: DiskTier | None) -> ReadOrRecompute:
        """The decision for an engine's disk tier (None: no disk, nothing ever to decide)."""
        if disk is None:
            return cls(lambda: math.inf)
        return cls(lambda: disk.read_bytes_per_s, kept=disk.rates_path)

    def observe(self, work: StepWork, seconds: float) -> None:
        """One step's prefill tokens and wall time (the step's decode rows ride along: a rate on the low side)."""
        if work.tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        rate = work.tokens / seconds
        self.tokens_per_s = rate if not self.measured else (1 - _SMOOTHING) * self.tokens_per_s + _SMOOTHING * rate
        self.measured = True

    def read(self, nbytes: int, tokens: int) -> bool:
        """True: read the entry; False: recompute its `tokens` (counted in `recomputed`)."""
        if nbytes / self.read_bytes_per_s() <= tokens / self.tokens_per_s:
            return True
        self.recomputed += 1
        return False

    def keep(self) -> None:
        """Write the prefill rate this engine measured to `kept`, for the next engine."""
        if self.kept is not None and self.measured:
            self.kept.write_text(json.dumps({"prefill_tokens_per_s": self.tokens_per_s}))


def _kept_rate(kept: Path | None) -> float | None:
    if kept is None or not kept.is_file():
        return None
    try:
        rate = json.loads(kept.read_text())["prefill_tokens_per_s"]
    except (ValueError, KeyError, TypeError):  # a torn or foreign file: measured again
        return None
    return rate if isinstance(rate, (int, float)) and rate > 0 else None


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
