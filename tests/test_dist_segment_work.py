"""A worker's side of segment parallelism: how a Build reaches the engine."""
from __future__ import annotations

import asyncio

import msgspec

from hypic.dist.messages import Arrived, Build, Job, KeyRef, PlannedJob, Progress
from hypic.dist.segment_work import SegmentWork


class RecordingEngine:
    """AsyncEngine's build_segments, recorded: the batch sizes it was asked for."""

    def __init__(self, fits: int) -> None:
        self.batches: list[int] = []
        self.fits = fits  # the pool holds this many tuples; the rest come back None

    async def build_segments(self, jobs: list) -> list:
        self.batches.append(len(jobs))
        return [object() if i < self.fits else None for i in range(len(jobs))]


def run_build(engine: RecordingEngine, count: int) -> list[msgspec.Struct]:
    reports: list[msgspec.Struct] = []

    async def report(message: msgspec.Struct) -> None:
        reports.append(message)

    jobs = [Job(PlannedJob(KeyRef(bytes([i]) * 16, None), (5, 6, 7, 8), (1, 3), True), transfer_id=i)
            for i in range(count)]
    work = SegmentWork(0, engine, transport=None, report=report)
    asyncio.run(work._build(Build("request", dest_node=0, dest_address="", jobs=jobs)))
    return reports


def test_a_build_s_segments_are_prefilled_in_one_engine_step() -> None:
    engine = RecordingEngine(fits=3)
    reports = run_build(engine, 3)
    assert engine.batches == [3]
    assert sorted(r.transfer_id for r in reports if isinstance(r, Progress) and r.event == "built") == [0, 1, 2]
    assert sorted(r.transfer_id for r in reports if isinstance(r, Arrived) and r.stored) == [0, 1, 2]


def test_a_segment_the_pool_cannot_hold_is_reported_failed_and_the_rest_go_on() -> None:
    engine = RecordingEngine(fits=2)
    reports = run_build(engine, 3)
    failed = [r for r in reports if isinstance(r, Progress) and r.event == "failed"]
    assert [r.transfer_id for r in failed] == [2] and failed[0].error.kind == "OutOfMemoryError"
    assert sorted(r.transfer_id for r in reports if isinstance(r, Arrived)) == [0, 1]
