"""The cold lane: a CUDA stream of its own on which a cold job's chunk runs beside the steps of
decodes and warm assemblies, instead of inside one of them.

In one stream a step of decodes and a cold chunk lasts as long as both (on the H200, Qwen3.5-35B-A3B:
~40 ms against ~6 for the decodes alone), so every decoder's next token waits for the chunk. On the
lane the chunk's graph runs across the next steps, which run on a stream of higher priority (`step`),
whose blocks the GPU starts first as the chunk's blocks finish.

The step that launches the chunk keeps no part of it: its captures are held here and kept (stored,
or carried to the job's next chunk) by the first step that finds the lane done (`land`), so no step
waits for the lane on the device. Meanwhile the scheduler takes no cold job chunk and never preempts
the lane's job (`PicState.on_lane`). Ordering, in both directions:
- a lane chunk starts after everything the engine queued before it (the pages, slot and tuple it
  reads may have been another sequence's a moment ago), and tensors the engine allocated that the
  chunk reads (a job's tuple so far) are recorded on the lane's stream, so that the allocator does
  not hand them out again before the chunk is done with them;
- the engine waits for the lane on the device (`join`) before reusing what its job holds when the
  job is dropped before it lands (an abort, a failed step).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hypic.engine.scheduler import ScheduledBatch
from hypic.engine.sequence import Sequence
from hypic.models.batch import Capture

# torch maps priorities past the device's range to its ends: the highest on any GPU
_URGENT = -16


class ColdLane:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)  # the lowest priority, as the engine's own stream
        self.step_stream = torch.cuda.Stream(device, priority=_URGENT)
        self.done = torch.cuda.Event()
        self.jobs: list[Sequence] = []  # whose chunks the lane may still be running
        self.held: tuple[ScheduledBatch, list[Capture]] | None = None  # the launching step, its captures

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def land(self, *, wait: bool = False) -> tuple[ScheduledBatch, list[Capture]] | None:
        """Once the lane's chunks are done (the host waits for them if `wait`), their step and
        captures, to keep; None while they run or when there are none."""
        if not self.jobs or not (wait or self.done.query()):
            return None
        self.done.synchronize()
        for job in self.jobs:
            job.pic.on_lane = False
        held, self.jobs, self.held = self.held, [], None
        return held

    def join(self) -> None:
        """The engine's later work waits for everything queued on the lane (on the device)."""
        if self.jobs:
            torch.cuda.current_stream().wait_stream(self.stream)

    @contextlib.contextmanager
    def chunks(self, batch: ScheduledBatch, jobs: list[Sequence]) -> Iterator[list[Capture]]:
        """Runs the block's device work on the lane, after the engine's queued work; the block adds
        the captures of `jobs`' chunks of `batch` to the list it gets, held until they land."""
        self.stream.wait_stream(torch.cuda.current_stream())
        for job in jobs:
            captured = job.pic.captured
            for tensor in ([] if captured is None else [*captured.T, *captured.S0]) + job.pic.captured_kv:
                tensor.record_stream(self.stream)
            job.pic.on_lane = True
        captures: list[Capture] = []
        self.jobs = jobs  # before the block: a block that fails leaves its jobs to the failed step's handling
        with torch.cuda.stream(self.stream):
            yield captures
            self.done.record()
        self.held = batch, captures

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """An engine step, on the high-priority stream, in order with the engine's other work."""
        main = torch.cuda.current_stream()
        self.step_stream.wait_stream(main)
        with torch.cuda.stream(self.step_stream):
            yield
        main.wait_stream(self.step_stream)
