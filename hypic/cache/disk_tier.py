"""The segment pool's disk tier (issue 28): one file per entry in a directory named by the model's identity.

The directory `<root>/<identity>/` belongs to one model: its identity hashes the format version, the
engine's fingerprint (which covers the weights: `hypic.models.checkpoint.weights_digest`), and the
entry layout (tuple dtypes and shapes). A directory of another model, version or layout has another
name and is never read. Reads and writes run on threads of their own; the index is the engine
thread's. Each file is a header (magic, version, identity, key digest, a hash of the
salt — never the salt itself —, interior, byte count, checksum) and the entry's bytes. A file that
fails any check is deleted and counts as a miss: it costs a recompute, never a wrong answer. A
file is written under a temporary name, then renamed. The read rate is measured at start-up (a
probe file), then from every read (its buffer, the read and the checksum: what a read costs).
Beside the files, `rates.json` keeps the figures an engine measured on this directory for the
next one (`rates_path`).
"""
from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from hypic.cache.segment_store import SegmentKey, SegmentLayout
from hypic.cache.tier_stats import TierStats

FORMAT_VERSION = 1
_MAGIC = b"HYPICSEG"
_HEADER = struct.Struct("<8sI16s16s16sQQQQ")  # magic, version, identity, digest, salt hash, start, end, bytes, sum
_PROBE_BYTES = 16 << 20  # well past the OS's read-ahead: a rate, not a latency
_SMOOTHING = 0.2  # weight of the newest read in the running read rate


@dataclass(frozen=True)
class _File:
    salt_hash: bytes
    interior: tuple[int, int]
    nbytes: int  # payload


@dataclass(frozen=True)
class DiskStats(TierStats):
    """`pinned`: writes under way; `demotions`: files written; `errors`: failed writes, and files
    found missing, truncated or corrupt. The engine fills in the last two fields."""

    read_bytes_per_s: float = 0.0  # measured at start-up, then from every read
    recompute_tokens_per_s: float = 0.0  # the engine's prefill rate it weighs reads against
    recomputed: int = 0  # entries recomputed rather than read: cheaper so (short segments, a slow disk)


def layout_signature(layout: SegmentLayout) -> str:
    """Everything that decides an entry's bytes, spelled out (no object addresses)."""
    linear = ";".join(f"{s.family.name},{s.value_heads},{s.key_dim},{s.value_dim},{s.conv_dim},{s.conv_kernel}"
                      for s in layout.linear)
    return (f"{linear}|{layout.num_full},{layout.kv_heads},{layout.head_dim}|"
            f"{layout.state_dtype}|{layout.model_dtype}|entry0={layout.entry_bytes(0)}")


def salt_hash(salt: str | None) -> bytes:
    return bytes(16) if salt is None else xxhash.xxh3_128(b"salt\x00" + salt.encode()).digest()


class DiskTier:
    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fingerprint: str, layout: SegmentLayout,
                 *, pin_reads: bool = False) -> None:
        """`pin_reads`: read entries into pinned memory (a GPU engine), so their promotion copies
        run asynchronously instead of making the engine thread wait for them."""
        self.layout, self._pin_reads = layout, pin_reads
        self.identity = xxhash.xxh3_128(f"{FORMAT_VERSION}|{fingerprint}|{layout_signature(layout)}".encode()).digest()
        self.directory = Path(root) / self.identity.hex()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[bytes, _File] = OrderedDict()  # key digest -> file, LRU first
        self._pending: list[tuple[Future, SegmentKey, _File]] = []
        self._doomed: set[bytes] = set()  # flushed while their write was under way
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hypic-disk-write")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="hypic-disk-read")
        self._counts = dict.fromkeys(("hits", "misses", "promotions", "demotions", "evictions", "errors"), 0)
        self._scan()
        self.read_bytes_per_s = self._measure_read_rate()
        self._reads_measured = False  # the probe's rate stands until the first read of an entry

    @property
    def rates_path(self) -> Path:
        """Where an engine keeps what it measured on this directory (JSON), for the next one."""
        return self.directory / "rates.json"

    def __contains__(self, key: SegmentKey) -> bool:
        found = self._index.get(key.digest)
        return found is not None and found.salt_hash == salt_hash(key.salt)

    def write(self, key: SegmentKey, interior: tuple[int, int], data: torch.Tensor,
              ready: torch.cuda.Event | None) -> Future | None:
        """Write an entry's bytes (valid once `ready` completes) on the writer thread; None when it
        can never fit. `data` must stay untouched until the future is done."""
        if data.numel() + _HEADER.size > self.capacity_bytes or any(k == key for _, k, _ in self._pending):
            return None
        record = _File(salt_hash(key.salt), interior, data.numel())
        future = self._writer.submit(self._write_file, key.digest, record, data, ready)
        self._pending.append((future, key, record))
        return future

    def start_read(self, key: SegmentKey) -> Future | None:
        """Read a stored entry on a reader thread (finish with `finish_read`); None on a miss."""
        if key not in self:
            self._counts["misses"] += 1
            return None
        return self._readers.submit(self._read_file, key.digest, self._index[key.digest])

    def finish_read(self, key: SegmentKey, read: Future) -> tuple[tuple[int, int], torch.Tensor] | None:
        """(interior, bytes) of a finished read that passed every check, or None (a miss)."""
        if read.exception() is not None:
            self._drop(key.digest, error=True)
        if read.exception() is not None or key not in self:  # failed, or flushed meanwhile
            self._counts["misses"] += 1
            return None
        self._index.move_to_end(key.digest)
        self._counts["hits"] += 1
        self._counts["promotions"] += 1
        data, seconds = read.result()
        self._observe_read(data.numel(), seconds)
        return self._index[key.digest].interior, data

    def close(self) -> None:
        """Wait for the writes and reads under way, then stop the threads (an engine shutting down)."""
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.reap()

    def flush(self, salt: str | None = None) -> int:
        wanted = salt_hash(salt)
        doomed = [d for d, f in self._index.items() if salt is None or f.salt_hash == wanted]
        for digest in doomed:
            self._drop(digest)
        self._doomed |= {k.digest for _, k, f in self._pending if salt is None or f.salt_hash == wanted}
        return len(doomed)

    def reap(self) -> None:
        """Index the files whose writes finished (dropping LRU files past the budget)."""
        still = []
        for future, key, record in self._pending:
            if not future.done():
                still.append((future, key, record))
            elif future.exception() is not None:
                self._counts["errors"] += 1
            else:
                self._indexed(key.digest, record)
        self._pending = still

    def stats(self) -> DiskStats:
        return DiskStats(len(self._index), self._bytes(), self.capacity_bytes, len(self._pending),
                         read_bytes_per_s=self.read_bytes_per_s, **self._counts)

    def _indexed(self, digest: bytes, record: _File) -> None:
        self._index[digest] = record
        self._counts["demotions"] += 1
        if digest in self._doomed:
            self._doomed.discard(digest)
            self._drop(digest)
        while self._bytes() > self.capacity_bytes and self._index:
            self._drop(next(iter(self._index)))
            self._counts["evictions"] += 1

    def _bytes(self) -> int:
        return sum(f.nbytes + _HEADER.size for f in self._index.values())

    def _drop(self, digest: bytes, error: bool = False) -> None:
        self._index.pop(digest, None)
        self._counts["errors"] += error
        self._path(digest).unlink(missing_ok=True)

    def _path(self, digest: bytes) -> Path:
        return self.directory / f"{digest.hex()}.seg"

    def _header(self, digest: bytes, record: _File, checksum: int) -> bytes:
        return _HEADER.pack(_MAGIC, FORMAT_VERSION, self.identity, digest, record.salt_hash,
                            *record.interior, record.nbytes, checksum)

    def _write_file(self, digest: bytes, record: _File, data: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()
        payload = data.numpy()  # written and hashed in place: a copy would hold the engine's GIL
        path = self._path(digest)
        temporary = path.with_suffix(".tmp")
        with open(temporary, "wb") as f:
            f.write(self._header(digest, record, xxhash.xxh3_64_intdigest(payload)))
            f.write(payload)
        os.replace(temporary, path)

    def _observe_read(self, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-9)
        smoothed = (1 - _SMOOTHING) * self.read_bytes_per_s + _SMOOTHING * rate
        self.read_bytes_per_s = smoothed if self._reads_measured else rate
        self._reads_measured = True

    def _read_file(self, digest: bytes, record: _File) -> tuple[torch.Tensor, float]:
        """The entry's bytes (checked) and the seconds it took to read them."""
        data, header, checksum, seconds = self._read_payload(self._path(digest), record.nbytes)
        if header != self._header(digest, record, checksum):
            raise ValueError(f"segment file {digest.hex()} fails its checksum or header")
        return data, seconds

    def _read_payload(self, path: Path, nbytes: int) -> tuple[torch.Tensor, bytes, int, float]:
        """(payload, header, payload checksum, seconds) of a file of `nbytes` after its header: the
        payload read straight into its buffer (no copies holding the GIL)."""
        start = time.perf_counter()
        data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin_reads)
        with open(path, "rb") as f:
            header, read, rest = f.read(_HEADER.size), f.readinto(data.numpy()), f.read(1)
        if len(header) < _HEADER.size or read != nbytes or rest:
            raise ValueError(f"segment file {path.name} is truncated")
        checksum = xxhash.xxh3_64_intdigest(data.numpy())
        return data, header, checksum, time.perf_counter() - start

    def _scan(self) -> None:
        """Index this identity's files (oldest first) from their headers; drop what cannot be trusted."""
        for path in sorted(self.directory.iterdir(), key=lambda p: p.stat().st_mtime):
            if path == self.rates_path:
                continue
            record = self._parse(path)
            if record is None:
                path.unlink(missing_ok=True)
            else:
                self._index[bytes.fromhex(path.stem)] = record
        while self._bytes() > self.capacity_bytes:  # the budget may have shrunk since the last run
            self._drop(next(iter(self._index)))

    def _parse(self, path: Path) -> _File | None:
        if path.suffix != ".seg":
            return None
        try:
            with open(path, "rb") as f:
                fields = _HEADER.unpack(f.read(_HEADER.size))
            digest = bytes.fromhex(path.stem)
        except (OSError, ValueError, struct.error):
            return None
        magic, version, identity, stored, salt, start, end, nbytes, _ = fields
        if (magic, version, identity, stored) != (_MAGIC, FORMAT_VERSION, self.identity, digest):
            return None
        if nbytes != self.layout.entry_bytes(end - start):
            return None
        return _File(salt, (start, end), nbytes)

    def _measure_read_rate(self) -> float:
        """Bytes per second of reading a freshly written file (dropped from the page cache where
        the OS allows) the way an entry is read (its buffer, the read, the checksum), so that a
        slow disk is known before it is relied on."""
        probe = self.directory / "read-rate.probe"
        with open(probe, "wb") as f:
            f.write(bytes(_HEADER.size) + os.urandom(_PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        seconds = self._read_payload(probe, _PROBE_BYTES)[-1]
        probe.unlink()
        return _PROBE_BYTES / max(seconds, 1e-9)
