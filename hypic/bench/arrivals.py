"""When requests go out: Poisson or gamma (bursty) arrivals, a trace's timestamps, a concurrency cap
and a conversation's turn order. The clock is injected, so scheduling is tested without wall time."""
from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from hypic.bench.workloads import BenchRequest
from hypic.errors import InvalidRequestError

R = TypeVar("R")


def arrival_times(count: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Offsets (s) of `count` arrivals at `rate` req/s: gamma gaps of shape `burstiness` and mean
    1/rate (burstiness 1 is Poisson, below 1 burstier); an infinite rate sends everything at 0."""
    if rate <= 0 or burstiness <= 0:
        raise InvalidRequestError(f"the request rate and burstiness must be positive; got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


@dataclass(frozen=True)
class Clock:
    now: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]]


WALL_CLOCK = Clock(time.perf_counter, asyncio.sleep)


@dataclass(frozen=True)
class Planned:
    """A request of a stream (`index` in it) and when it arrives (s after the start)."""

    index: int
    arrival_s: float
    request: BenchRequest


@dataclass(frozen=True)
class Dispatched(Generic[R]):
    """What happened to a planned request: when it was sent (s after the start) and its result."""

    planned: Planned
    sent_s: float
    result: R


async def dispatch(plan: Sequence[Planned], send: Callable[[BenchRequest], Awaitable[R]], *, clock: Clock = WALL_CLOCK,
                   max_concurrency: int | None = None,
                   on_done: Callable[[R], None] = lambda result: None) -> list[Dispatched[R]]:
    """Send each request at its arrival time, or later: once its previous turn (`after`) has finished
    and fewer than max_concurrency requests are in flight. Results in plan order."""
    start = clock.now()
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    finished = {item.index: asyncio.Event() for item in plan}

    async def run(item: Planned) -> Dispatched[R]:
        if item.request.after in finished:  # a turn whose predecessor is in an earlier batch has no wait
            await finished[item.request.after].wait()
        async with gate:
            sent = clock.now() - start
            result = await send(item.request)
        finished[item.index].set()
        on_done(result)
        return Dispatched(item, sent, result)

    tasks = []
    for item in sorted(plan, key=lambda item: item.arrival_s):
        delay = start + item.arrival_s - clock.now()
        if delay > 0:
            await clock.sleep(delay)
        tasks.append((item.index, asyncio.create_task(run(item))))
    done = {index: await task for index, task in tasks}
    return [done[item.index] for item in plan]
