"""Giving memory back after large requests.

A refused large body stays alive in a reference cycle (an exception's traceback holds the frame
that held the body) until the cycle collector runs, and what is freed stays in glibc's heaps. After
each request whose body was large: a collection, then `malloc_trim`, which hands free pages back
to the system. Without glibc, the collection alone. The objects alive once the engine has started
(the model's, ~300k) are frozen out of collections, which then take milliseconds instead of most of
a second.

Large bodies are decoded, and the heap trimmed, on one thread of their own (ctypes releases the
GIL): glibc gives each thread that allocates an arena of its own, and decodes spread over the event
loop's executor (whichever thread was idle, a new one when none was, as under load) left free
memory in several arenas, so resident memory after a burst depended on the scheduling.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

LARGE_BODY_BYTES = 1 << 20  # bodies this large are decoded on the large-body thread, smaller ones inline
Result = TypeVar("Result")


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


class LargeBodies:
    """The one thread that decodes large bodies and gives their memory back, and the turn that lets
    one large body at a time be read and decoded (a decoded body may take many times its bytes)."""

    def __init__(self) -> None:
        self.turn = asyncio.Semaphore(1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hypic-large-bodies")

    async def decode(self, decode: Callable[..., Result], *args: object) -> Result:
        """`decode(*args)` on the thread; the caller holds the turn, so no other decode re-enables
        the collector early."""
        with _collector_paused():
            return await self._run(decode, *args)

    async def give_back_memory(self) -> None:
        gc.collect()  # on the event loop: finalizers of what it frees may touch the loop
        trim = _malloc_trim()
        if trim is not None:
            await self._run(trim, 0)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., Result], *args: object) -> Result:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Decoding a large body into many small objects runs ~5x faster without the cycle collector
    walking them again and again (give_back_memory collects once afterwards)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@functools.cache
def _malloc_trim():  # noqa: ANN202 - a ctypes function, or None
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)
