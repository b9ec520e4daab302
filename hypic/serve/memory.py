"""Giving memory back after large requests.

A refused large body stays alive in a reference cycle (an exception's traceback holds the frame
that held the body) until the cycle collector runs, and what is freed stays in glibc's heaps. After
each request whose body was large: a collection, then `malloc_trim`, which hands free pages back
to the system, in a worker thread (ctypes releases the GIL). Without glibc, the collection alone.
The objects alive once the engine has started (the model's, ~300k) are frozen out of collections,
which then take milliseconds instead of most of a second.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager

LARGE_BODY_BYTES = 1 << 20


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


@contextmanager
def collector_paused() -> Iterator[None]:
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


async def give_back_memory() -> None:
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        await asyncio.to_thread(trim, 0)
