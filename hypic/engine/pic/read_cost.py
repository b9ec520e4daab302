"""Read a disk-only segment, or recompute it? (issue 28: short segments and slow disks recompute.)

Reading costs the entry's bytes over the disk's read rate (measured at start-up); recomputing costs
the segment's tokens over the engine's prefill rate, measured from its own steps. Until a step has
been measured the prefill rate is a constant that leans towards reading (slower than any GPU, the
speed of a small model on a few CPU cores), so a fresh engine never recomputes what a disk could
have served faster.
"""
from __future__ import annotations

import time

import torch

UNMEASURED_TOKENS_PER_S = 2000.0
MIN_MEASURED_TOKENS = 64  # steps with fewer prefill tokens say more about overheads than about the rate
_SMOOTHING = 0.2  # weight of the newest step in the running rate


class ReadOrRecompute:
    def __init__(self, read_bytes_per_s: float, tokens_per_s: float = UNMEASURED_TOKENS_PER_S) -> None:
        self.read_bytes_per_s, self.tokens_per_s = read_bytes_per_s, tokens_per_s
        self.measured = False
        self.recomputed = 0  # disk entries recomputed because that was cheaper

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """One step's prefill tokens and wall time (the step's decode rows ride along: a rate on the low side)."""
        if prefill_tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        rate = prefill_tokens / seconds
        self.tokens_per_s = rate if not self.measured else (1 - _SMOOTHING) * self.tokens_per_s + _SMOOTHING * rate
        self.measured = True

    def read(self, nbytes: int, tokens: int) -> bool:
        """True: read the entry; False: recompute its `tokens` (counted in `recomputed`)."""
        if nbytes / self.read_bytes_per_s <= tokens / self.tokens_per_s:
            return True
        self.recomputed += 1
        return False


class StepClock:
    """Times steps for `ReadOrRecompute.observe` without ever waiting on the device: on a GPU a pair
    of CUDA events per step, read once the second has completed; elsewhere the host clock."""

    def __init__(self, device: torch.device, costs: ReadOrRecompute) -> None:
        self._cuda, self._costs = device.type == "cuda", costs
        self._open: tuple[int, float | torch.cuda.Event] | None = None
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, prefill_tokens: int) -> None:
        """Before a step's forward; `prefill_tokens` 0 for a step not worth measuring."""
        self._open = None
        if prefill_tokens >= MIN_MEASURED_TOKENS:
            self._open = (prefill_tokens, self._mark())

    def stop(self) -> None:
        """After the step; hands every completed measurement to the cost model."""
        if self._open is not None:
            tokens, began = self._open
            if self._cuda:
                self._pending.append((tokens, began, self._mark()))
            else:
                self._costs.observe(tokens, time.perf_counter() - began)
        marks = [(p, p[2].query()) for p in self._pending]
        self._pending = [p for p, done in marks if not done]
        for tokens, began, ended in [p for p, done in marks if done]:
            self._costs.observe(tokens, began.elapsed_time(ended) / 1000)

    def _mark(self) -> float | torch.cuda.Event:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
