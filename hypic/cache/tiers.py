"""The segment pool's lower tiers (issue 28): a host arena below the GPU pool, a disk directory below it.

An entry the pool evicts is demoted (its bytes copied down, whatever its layout), not dropped; a
lower-tier hit is promoted back into the pool before assembly. Each tier is LRU over its own budget,
and an entry is pinned while a copy still reads it. On a GPU engine the host arena is pinned memory
and every copy between it and the pool runs on one side stream, so copies are ordered among
themselves and overlap the engine's work: a request using a promoted entry is scheduled once its
copy's event has completed (no other request waits), and an evicted entry's pool space is reused
once its demotion copy has. On a CPU engine copies are plain memcpys. A disk read lands in the host
arena, as a host entry (its first claim a disk hit): the memory the tier already holds, never an
allocation per read. Single-threaded (the engine loop owns it); the disk tier's reads and writes,
and the pinning of the host arena's slabs, run on threads of their own.
"""
from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass

import torch

from hypic.cache.disk_tier import DiskTier
from hypic.cache.segment_store import ALIGN, FreeList, SegmentKey, drop_salt, window_to_evict
from hypic.cache.tier_stats import TierStats

logger = logging.getLogger("hypic")

@dataclass(eq=False)
class Claim:
    """A lower-tier entry held for promotion: `data` stays valid until `LowerTiers.copy_up` or `release`."""

    key: SegmentKey
    interior: tuple[int, int]
    data: torch.Tensor  # the entry's bytes in host memory
    tier: str  # "host", or "disk": read into host memory for this claim
    held: _Held  # the host-arena entry it pins

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass(eq=False)
class _Held:
    key: SegmentKey
    interior: tuple[int, int]
    offset: int
    nbytes: int
    pins: int = 0
    from_disk: bool = False  # read from disk and not claimed since: its first claim is a disk hit


class SideCopies:
    """Copies between the pool and host memory: on a GPU engine queued on one side stream after
    the work already on the engine's stream, each marked by an event; elsewhere done at once."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        if self.stream is None:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event


class HostArena:
    """The host tier's memory in slabs, so that an engine does not pin tens of GB before it serves
    (and torch's pinned allocator, which rounds one request up to a power of two, pins no more than
    the budget). The first slab is made at once; on a GPU engine the others are pinned on a thread
    of their own, one ahead of the entries: the second once the first is full (so not while the
    engine captures its CUDA graphs, which a pinned allocation from another thread can
    invalidate), each next one once the last pinned is taken (a demotion that finds the next one
    not yet pinned evicts below instead of waiting). Pinning holds the CUDA driver's lock, and the
    engine's launches wait while it does: an engine pins only as fast as its entries need slabs,
    and no more than they need. Elsewhere a slab is made when needed. Slabs sit a gap apart in the
    offset space, so holes never merge across two and an entry never spans them. A slab the host
    cannot allocate ends the growth. `close` stops the pinning and lets every slab go (torch's
    pinned allocator keeps them for the next engine of the process, which then pins nothing anew)."""

    def __init__(self, capacity_bytes: int, slab_bytes: int, pin: bool) -> None:
        self.slab_bytes = min(slab_bytes, capacity_bytes // ALIGN * ALIGN)
        self.capacity_bytes = capacity_bytes // self.slab_bytes * self.slab_bytes if self.slab_bytes else 0
        self.free = FreeList(0)
        self._stride = self.slab_bytes + ALIGN
        self._slabs: list[torch.Tensor] = []
        self._pinned: queue.SimpleQueue | None = None  # slabs pinned ahead, in order (a GPU engine)
        self._spare: torch.Tensor | RuntimeError | None = None  # taken from `_pinned`, not yet used
        if self.capacity_bytes:
            self._add(_new_slab(self.slab_bytes, pin))
        self._pinner: threading.Thread | None = None
        self._closed = threading.Event()
        self._wanted = threading.Semaphore(1)  # slabs to pin: one ahead, another each time one is taken
        if pin and self.capacity_bytes > self.slab_bytes:
            self._pinned = queue.SimpleQueue()
            count = self.capacity_bytes // self.slab_bytes - 1
            args = (weakref.ref(self), self._pinned, count, self._closed, self._wanted)
            self._pinner = threading.Thread(target=_pin_ahead, args=args, name="hypic-host-pin", daemon=True)
            weakref.finalize(self, _stop_pinning, self._closed, self._wanted)  # collected unclosed

    @property
    def slabs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._slabs)

    @property
    def allocated_bytes(self) -> int:
        return len(self._slabs) * self.slab_bytes

    @property
    def used_bytes(self) -> int:
        return self.allocated_bytes - self.free.free_bytes

    def grow(self) -> bool:
        """Add the next slab; False at the budget, or while the next one is still being pinned."""
        if self.allocated_bytes >= self.capacity_bytes:
            return False
        if self._pinned is None:
            return self._add(_new_slab(self.slab_bytes, pin=False))
        if self._spare is None:
            self._start_pinning()
            try:
                self._spare = self._pinned.get_nowait()
            except queue.Empty:
                return False
        slab, self._spare = self._spare, None
        self._wanted.release()  # the next one
        return self._add(slab)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        slab, start = divmod(offset, self._stride)
        return self._slabs[slab][start: start + nbytes]

    def fill(self) -> None:
        """Take every slab of the budget now, waiting for their pinning (a benchmark that measures
        serving, not the pinning, calls it before the first request)."""
        while self.allocated_bytes < self.capacity_bytes:
            self.wait()
            if not self.grow():  # the host could not allocate one: the budget ends here
                return

    def wait(self) -> None:
        """Until the next slab is pinned (tests, benchmarks)."""
        if self._pinned is not None and self._spare is None and self.allocated_bytes < self.capacity_bytes:
            self._start_pinning()
            self._spare = self._pinned.get()

    def close(self) -> None:
        """Stop pinning (the slab being pinned, if any, is finished first) and drop every slab;
        the arena holds nothing afterwards."""
        _stop_pinning(self._closed, self._wanted)
        if self._pinner is not None and self._pinner.ident is not None:
            self._pinner.join()
        self._slabs, self._spare, self._pinned = [], None, None
        self.free, self.capacity_bytes = FreeList(0), 0

    def _start_pinning(self) -> None:
        if self._pinner.ident is None:
            self._pinner.start()

    def _add(self, slab: torch.Tensor | RuntimeError) -> bool:
        if isinstance(slab, RuntimeError):
            logger.warning("host tier: cannot allocate another %d MiB slab (%s); it stays at %d MiB",
                           self.slab_bytes >> 20, slab, self.allocated_bytes >> 20)
            self.capacity_bytes = self.allocated_bytes
            return False
        self.free.release(len(self._slabs) * self._stride, self.slab_bytes)
        self._slabs.append(slab)
        return True


def _pin_ahead(arena: weakref.ref[HostArena], pinned: queue.SimpleQueue, count: int,
               closed: threading.Event, wanted: threading.Semaphore) -> None:
    """Pins up to `count` slabs for `arena` (the pinning thread), each once `wanted`; stops once the
    arena is closed or gone (an engine closed), so that it pins nothing for nobody, nor beside the
    next engine's graph capture."""
    for _ in range(count):
        wanted.acquire()
        owner = arena()
        if owner is None or closed.is_set():
            return
        nbytes, owner = owner.slab_bytes, None
        slab = _new_slab(nbytes, pin=True)
        pinned.put(slab)
        if isinstance(slab, RuntimeError):
            return


def _stop_pinning(closed: threading.Event, wanted: threading.Semaphore) -> None:
    closed.set()
    wanted.release()  # wakes the pinning thread to see it


def _new_slab(nbytes: int, pin: bool) -> torch.Tensor | RuntimeError:
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as error:  # out of (pinnable) memory
        return error


class LowerTiers:
    """The host arena (and the disk tier under it) as the pool sees them: demote, claim, copy up, flush."""

    def __init__(self, capacity_bytes: int, device: torch.device, disk: DiskTier | None,
                 slab_bytes: int = 1 << 30) -> None:
        """`slab_bytes`: the host arena's unit of growth, and the largest entry it can hold."""
        self.arena = HostArena(capacity_bytes, slab_bytes, pin=device.type == "cuda")
        self._index: OrderedDict[SegmentKey, _Held] = OrderedDict()  # LRU first
        self._flushed: list[_Held] = []  # dropped while pinned: freed on their last unpin
        self._copies = SideCopies(device)
        self._in_flight: list[tuple[torch.cuda.Event | None, _Held, torch.Tensor]] = []
        self._writes: list[tuple[futures.Future, _Held]] = []  # (disk write future, host entry it reads)
        self._reads: dict[SegmentKey, tuple[futures.Future, _Held]] = {}  # disk reads under way, into the arena
        self.disk = disk
        self._counts = dict.fromkeys(("hits", "misses", "promotions", "demotions", "evictions"), 0)
        self._moved: set[SegmentKey] = set()  # host entries evicted or read in since `take_moved`

    @property
    def capacity_bytes(self) -> int:
        return self.arena.capacity_bytes

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self._index or (self.disk is not None and key in self.disk)

    def tier(self, key: SegmentKey) -> str | None:
        if key in self._index:
            return "host"
        return "disk" if self.disk is not None and key in self.disk else None

    def take_moved(self) -> set[SegmentKey]:
        moved, self._moved = self._moved, set()
        return moved

    def demote(self, key: SegmentKey, interior: tuple[int, int], src: torch.Tensor) -> torch.cuda.Event | None:
        """Copy a pool entry's bytes down. Returns the copy's event (None: done, or not copied);
        the pool must not reuse `src` before it completes."""
        self.reap()
        if key in self._index:  # promoted earlier and unchanged since (entries never change)
            self._index.move_to_end(key)
            return None
        offset = self._allocate(src.numel())
        if offset is None:
            return None  # pinned entries hold the arena (or it never fits): dropped, a later hit recomputes
        held = self._index[key] = _Held(key, interior, offset, src.numel())
        event = self._copies.copy(self._bytes(held), src)
        self._counts["demotions"] += 1
        if self.disk is not None and key not in self.disk:
            self._write_down(held, event)
        return event

    def start_read(self, key: SegmentKey) -> bool:
        """Start reading an entry only the disk holds into the host arena (off the engine thread);
        True while one is under way (`finished_reads` tells when). False also when pinned host
        entries leave no room for it: it is recomputed rather than waited for."""
        if key not in self._reads and key not in self._index and self.disk is not None and key in self.disk:
            self._read_into_arena(key, self.disk.entry_bytes(key))
        return key in self._reads

    @property
    def reading_bytes(self) -> int:
        """Bytes of the disk reads not done yet (what a read started now queues behind)."""
        return sum(held.nbytes for read, held in self._reads.values() if not read.done())

    def finished_reads(self) -> list[SegmentKey]:
        """Keys whose disk reads finished since the last call. Each that passed its checks is a
        host entry now (`claim` promotes it); a failed one's room is given back."""
        done = [key for key, (read, _) in self._reads.items() if read.done()]
        for key in done:
            self._land(key, *self._reads.pop(key))
        return done

    def claim(self, key: SegmentKey) -> Claim | None:
        """Hold a host entry for promotion (one a disk read just landed counts as a disk hit), or
        None on a miss."""
        self.reap()
        held = self._index.get(key)
        if held is None:
            self._counts["misses"] += 1
            return None
        tier, held.from_disk = "disk" if held.from_disk else "host", False
        self._counts["hits" if tier == "host" else "misses"] += 1  # a disk hit is the host's miss
        self._index.move_to_end(key)
        held.pins += 1
        return Claim(key, held.interior, self._bytes(held), tier, held)

    def copy_up(self, claim: Claim, dst: torch.Tensor) -> torch.cuda.Event | None:
        """Copy a claimed entry into the pool; returns the copy's event (None: done). Only the
        requests using the entry wait for it (they are scheduled once it has landed)."""
        event = self._copies.copy(dst, claim.data)
        self._in_flight.append((event, claim.held, claim.data))  # pins and buffers live until it lands
        if claim.tier == "host":
            self._counts["promotions"] += 1
        self.reap()
        return event

    def release(self, claim: Claim) -> None:
        """Give a claim back unused (the pool had no room: the request recomputes instead of waiting)."""
        self._unpin(claim.held)

    def flush(self, salt: str | None = None) -> int:
        """Drop every entry (of one salt) from both tiers; returns how many were dropped."""
        dropped = drop_salt(self._index, self._flushed, self.arena.free, salt)
        return dropped + (self.disk.flush(salt) if self.disk is not None else 0)

    def reap(self) -> None:
        """Unpin what finished copies and disk writes held."""
        landed, self._in_flight = _split(self._in_flight, lambda item: item[0] is None or item[0].query())
        written, self._writes = _split(self._writes, lambda item: item[0].done())
        for held in [h for _, h, _ in landed] + [h for _, h in written]:
            self._unpin(held)
        if self.disk is not None:
            self.disk.reap()

    def drain(self) -> None:
        """Wait for every copy, disk write, disk read and slab pinning under way (tests, benchmarks)."""
        self.arena.wait()
        self._settle()

    def close(self) -> None:
        """Let the host memory go (an engine shutting down): once the copies, disk writes and reads
        under way are done, every entry is dropped from host memory (the disk keeps its files) and
        the arena's slabs are released; the counters stay."""
        self._settle()
        self._index.clear()
        self._flushed, self._reads = [], {}
        self.arena.close()
        if self.disk is not None:
            self.disk.close()

    def _settle(self) -> None:
        for event, _, _ in self._in_flight:
            if event is not None:
                event.synchronize()
        futures.wait([future for future, _ in self._writes] + [read for read, _ in self._reads.values()])
        self.reap()

    def stats(self) -> TierStats:
        pinned = sum(1 for h in self._index.values() if h.pins) + len(self._flushed)
        return TierStats(len(self._index), self.arena.used_bytes, self.capacity_bytes, pinned, **self._counts)

    def _write_down(self, held: _Held, event: torch.cuda.Event | None) -> None:
        future = self.disk.write(held.key, held.interior, self._bytes(held), event)
        if future is not None:
            held.pins += 1
            self._writes.append((future, held))

    def _allocate(self, nbytes: int) -> int | None:
        """Room in the arena: free space, its next slabs (if already pinned), or the window of unpinned
        entries that costs least to evict (`eviction_window`)."""
        if nbytes > self.arena.slab_bytes:
            return None
        offset = self.arena.free.allocate_making_room(nbytes, self.arena.grow)
        if offset is None and self._evict_window(nbytes):
            offset = self.arena.free.allocate(nbytes)
        return offset

    def _evict_window(self, nbytes: int) -> bool:
        """Evict the entries of the cheapest window of `nbytes` (False: pins leave none). Entries
        being read from disk and flushed ones still pinned cannot go."""
        occupied = [(h.offset, h.nbytes, None if h.pins else rank, h) for rank, h in enumerate(self._index.values(), 1)]
        taken = (*self._flushed, *(held for _, held in self._reads.values()))
        doomed = window_to_evict(self.arena.free.holes, occupied + [(h.offset, h.nbytes, None, None) for h in taken],
                                 nbytes)
        if doomed is None:
            return False
        for held in doomed:
            del self._index[held.key]
            self.arena.free.release(held.offset, held.nbytes)
            self._moved.add(held.key)
            self._counts["evictions"] += 1
        return True

    def _read_into_arena(self, key: SegmentKey, nbytes: int) -> None:
        offset = self._allocate(nbytes)
        if offset is None:
            return
        held = _Held(key, (0, 0), offset, nbytes, pins=1)  # its interior comes with the file's header
        read = self.disk.start_read(key, self._bytes(held))
        if read is None:
            self.arena.free.release(offset, nbytes)
        else:
            self._reads[key] = (read, held)

    def _land(self, key: SegmentKey, read: futures.Future, held: _Held) -> None:
        """Index a finished read's entry (pins none) unless it failed, was flushed meanwhile, or the
        key came down from the pool meanwhile (the entry is host memory already)."""
        interior = self.disk.finish_read(key, read)
        if interior is None or key in self._index:
            self.arena.free.release(held.offset, held.nbytes)
            return
        held.interior, held.pins, held.from_disk = interior, 0, True
        self._index[key] = held
        self._moved.add(key)  # its best tier: host now

    def _unpin(self, held: _Held) -> None:
        held.pins -= 1
        if held.pins == 0 and held in self._flushed:
            self._flushed.remove(held)
            self.arena.free.release(held.offset, held.nbytes)

    def _bytes(self, held: _Held) -> torch.Tensor:
        return self.arena.view(held.offset, held.nbytes)


def _split(items: list, done) -> tuple[list, list]:
    """(the items `done` holds for, the others), each in order."""
    marks = [done(item) for item in items]
    return [i for i, m in zip(items, marks) if m], [i for i, m in zip(items, marks) if not m]
