"""The parts a step launched (an eager forward, the decode graph, assembly graph replays) with their
times, for the engine's debug log: where a step's time goes under load, part by part, without a
profiler. On a GPU each part has its launch time on the host and its time on the device (CUDA
events, read after the step's own sync: no sync more); on a CPU, where launching is running, the
host time alone. Off unless the log wants them: then a part costs two events."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Part:
    host_s: float
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None


class StepParts:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False
        self.names: list[str] = []  # the last step's parts, timed or not
        self._parts: list[_Part] = []

    def start_step(self, enabled: bool) -> None:
        self.enabled, self.names, self._parts = enabled, [], []

    @contextlib.contextmanager
    def part(self, name: str, *, waited: bool = True) -> Iterator[None]:
        """`waited`: the step reads its tokens after the part ends (else no device time)."""
        self.names.append(name)
        if not self.enabled:
            yield
            return
        timed = self.cuda and waited
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timed else None
        began = time.perf_counter()
        if events:
            events[0].record()
        yield
        if events:
            events[1].record()
        self._parts.append(_Part(time.perf_counter() - began, events))

    def times(self) -> str:
        """Each part's "host/device" ms ("host" on a CPU or the lane), in launch order; after the step's sync."""
        return ", ".join(map(_times, self._parts)) + (" ms, host/device" if self.cuda else " ms")


def _times(part: _Part) -> str:
    host = f"{part.host_s * 1e3:.1f}"
    if part.events is None:
        return host
    part.events[1].synchronize()  # done already: the step read its tokens after every part
    return f"{host}/{part.events[0].elapsed_time(part.events[1]):.1f}"
