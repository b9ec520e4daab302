"""Read a disk-only segment, or recompute it? (issue 28: short segments and slow disks recompute.)

Reading costs the entry's bytes over the disk's read rate (measured at start-up); recomputing costs
the segment's tokens over the engine's prefill rate, measured from its own steps. Until a step has
been measured the prefill rate is a constant that leans towards reading (slower than any GPU, the
speed of a small model on a few CPU cores), so a fresh engine never recomputes what a disk could
have served faster.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from hypic.engine.prefill_cost import StepWork

UNMEASURED_TOKENS_PER_S = 2000.0
MIN_MEASURED_TOKENS = 64  # steps with fewer prefill tokens say more about overheads than about the rate
_SMOOTHING = 0.2  # weight of the newest step in the running rate


class ReadOrRecompute:
    def __init__(self, read_bytes_per_s: float, tokens_per_s: float = UNMEASURED_TOKENS_PER_S) -> None:
        self.read_bytes_per_s, self.tokens_per_s = read_bytes_per_s, tokens_per_s
        self.measured = False
        self.recomputed = 0  # disk entries recomputed because that was cheaper

    def observe(self, work: StepWork, seconds: float) -> None:
        """One step's prefill tokens and wall time (the step's decode rows ride along: a rate on the low side)."""
        if work.tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        rate = work.tokens / seconds
        self.tokens_per_s = rate if not self.measured else (1 - _SMOOTHING) * self.tokens_per_s + _SMOOTHING * rate
        self.measured = True

    def read(self, nbytes: int, tokens: int) -> bool:
        """True: read the entry; False: recompute its `tokens` (counted in `recomputed`)."""
        if nbytes / self.read_bytes_per_s <= tokens / self.tokens_per_s:
            return True
        self.recomputed += 1
        return False


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
