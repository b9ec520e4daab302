"""Giving memory back after large requests.

A large body leaves freed but unreturned memory behind in glibc's heaps (its bytes, their decoded
text, the tokenizer's buffers). `malloc_trim` hands free pages back to the system; it runs in a
worker thread (ctypes releases the GIL) after each request whose body was large, and nowhere
else (elsewhere a no-op: other C libraries return memory on their own terms).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools

LARGE_BODY_BYTES = 1 << 20


@functools.cache
def _malloc_trim():  # noqa: ANN202 - a ctypes function, or None
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)


async def give_back_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        await asyncio.to_thread(trim, 0)
