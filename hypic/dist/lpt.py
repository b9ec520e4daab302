"""Longest-Processing-Time-first assignment of segments to workers (paper §4.4, eq. 9).

Minimising the heaviest worker's token load is multiprocessor scheduling (NP-hard). LPT — largest
segment first, each to the currently least-loaded worker — is within 4/3 - 1/(3m) of the optimum
(Graham 1969), in O(n log n + n log m). Ties are broken deterministically: equal sizes keep their
given order, equal loads go to the lowest worker index.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Assignment:
    owner: tuple[int, ...]  # owner[i]: the worker index segment i goes to
    loads: tuple[int, ...]  # each worker's final load, its start load included
    order: tuple[int, ...]  # segment indices in the order they were placed (largest first)

    @property
    def makespan(self) -> int:
        return max(self.loads)

    def segments_of(self, worker: int) -> tuple[int, ...]:
        """The worker's segments, largest first: the order to prefill them in, so that the last,
        smallest one's transfer is the only one not hidden behind a prefill."""
        return tuple(i for i in self.order if self.owner[i] == worker)


def lpt_assign(sizes: Sequence[int], num_workers: int, start_loads: Sequence[int] | None = None) -> Assignment:
    """Assign segments of `sizes` tokens to `num_workers` workers whose loads start at `start_loads`
    (tokens already queued on them; zeros when None)."""
    loads = _checked_loads(sizes, num_workers, start_loads)
    heap = [(load, worker) for worker, load in enumerate(loads)]
    heapq.heapify(heap)
    order = tuple(sorted(range(len(sizes)), key=lambda i: -sizes[i]))  # stable: ties keep their order
    owner = [0] * len(sizes)
    for i in order:
        load, worker = heapq.heappop(heap)
        owner[i] = worker
        loads[worker] = load + sizes[i]
        heapq.heappush(heap, (loads[worker], worker))
    return Assignment(tuple(owner), tuple(loads), order)


def _checked_loads(sizes: Sequence[int], num_workers: int, start_loads: Sequence[int] | None) -> list[int]:
    if num_workers < 1:
        raise ValueError(f"LPT needs at least one worker, got {num_workers}")
    if any(size < 0 for size in sizes):
        raise ValueError(f"segment sizes must be >= 0, got {list(sizes)}")
    if start_loads is None:
        return [0] * num_workers
    if len(start_loads) != num_workers or any(load < 0 for load in start_loads):
        raise ValueError(f"start_loads must be {num_workers} values >= 0, got {list(start_loads)}")
    return list(start_loads)
