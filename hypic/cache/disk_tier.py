"""The segment pool's disk tier (issue 28): one file per entry in a directory named by the model's identity.

The directory `<root>/<identity>/` belongs to one model: its identity hashes the format version, the
engine's fingerprint (which covers the weights: `hypic.models.checkpoint.weights_digest`), and the
entry layout (tuple dtypes and shapes). A directory of another model, version or layout has another
name and is never read. Reads and writes run on threads of their own; the index is the engine
thread's. Each file is a header (magic, version, identity, key digest, a hash of the
salt — never the salt itself —, interior, byte count, checksum) and the entry's bytes. A file that
fails any check is deleted and counts as a miss: it costs a recompute, never a wrong answer. A
file is written under a temporary name, then renamed. A read lands in memory its caller owns (the
host tier's arena): nothing is allocated per read, least of all pinned memory, whose allocation
holds the CUDA driver's lock and so stalls the engine's launches.

The read rate is the disk's overall throughput (`ReadMeter`: bytes over the wall time during which
reads were under way, however many at once), what a request reading several entries sees. Beside
the files, `rates.json` keeps what engines measured on this directory (this read rate, and the
engine's prefill rate: `hypic.engine.pic.read_cost`) for the next one; only a directory without a
recorded read rate is probed at start-up.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from hypic.cache.segment_store import SegmentKey, SegmentLayout
from hypic.cache.tier_stats import TierStats

FORMAT_VERSION = 1
_MAGIC = b"HYPICSEG"
_HEADER = struct.Struct("<8sI16s16s16sQQQQ")  # magic, version, identity, digest, salt hash, start, end, bytes, sum
_PROBE_BYTES = 16 << 20  # per probe file: well past the OS's read-ahead, a rate, not a latency
READERS = 2  # reads under way at once
READ_RATE = "read_bytes_per_s"  # its key in the rates file


@dataclass(frozen=True)
class _File:
    salt_hash: bytes
    interior: tuple[int, int]
    nbytes: int  # payload


@dataclass(frozen=True)
class DiskStats(TierStats):
    """`pinned`: writes under way; `demotions`: files written; `errors`: failed writes, and files
    found missing, truncated or corrupt. The engine fills in the last two fields."""

    read_bytes_per_s: float = 0.0  # overall throughput: kept or probed at start-up, then from this engine's reads
    recompute_tokens_per_s: float = 0.0  # the engine's prefill rate it weighs reads against
    recomputed: int = 0  # entries recomputed rather than read: cheaper so (short segments, a slow disk)
    late: int = 0  # reads not done by their deadline: recomputed instead (the read still lands in host memory)


def layout_signature(layout: SegmentLayout) -> str:
    """Everything that decides an entry's bytes, spelled out (no object addresses)."""
    linear = ";".join(f"{s.family.name},{s.value_heads},{s.key_dim},{s.value_dim},{s.conv_dim},{s.conv_kernel}"
                      for s in layout.linear)
    return (f"{linear}|{layout.num_full},{layout.kv_heads},{layout.head_dim}|"
            f"{layout.state_dtype}|{layout.model_dtype}|entry0={layout.entry_bytes(0)}")


def salt_hash(salt: str | None) -> bytes:
    return bytes(16) if salt is None else xxhash.xxh3_128(b"salt\x00" + salt.encode()).digest()


def kept_rates(path: Path) -> dict[str, float]:
    """The positive figures a rates file holds ({} when there is none, or it is torn or foreign)."""
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(figures, dict):
        return {}
    return {k: float(v) for k, v in figures.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def keep_rates(path: Path, **figures: float) -> None:
    """Merge `figures` into a rates file (written whole, then renamed: never torn); nothing when its
    directory is gone."""
    if not path.parent.is_dir():
        return
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({**kept_rates(path), **figures}))
    os.replace(temporary, path)


class ReadMeter:
    """Overall read throughput: the bytes of finished reads over the wall time during which at
    least one read was under way. Concurrent reads share the disk, so a per-read rate (its bytes
    over its own time) understates what several reads at once deliver. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock, self._lock = clock, threading.Lock()
        self._under_way, self._since, self.busy_s, self.nbytes = 0, 0.0, 0.0, 0

    @property
    def bytes_per_s(self) -> float | None:
        """None until a read has finished."""
        with self._lock:
            return self.nbytes / self.busy_s if self.nbytes and self.busy_s > 0 else None

    def started(self) -> None:
        with self._lock:
            now = self._clock()
            if self._under_way:
                self.busy_s += now - self._since
            self._under_way, self._since = self._under_way + 1, now

    def finished(self, nbytes: int) -> None:
        with self._lock:
            now = self._clock()
            self.busy_s += now - self._since
            self._under_way, self._since, self.nbytes = self._under_way - 1, now, self.nbytes + nbytes


class DiskTier:
    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fingerprint: str, layout: SegmentLayout,
                 *, readers: Executor | None = None) -> None:
        """`readers`: where reads run (default: READERS threads; tests inject one whose reads they
        finish when they choose)."""
        self.layout = layout
        self.identity = xxhash.xxh3_128(f"{FORMAT_VERSION}|{fingerprint}|{layout_signature(layout)}".encode()).digest()
        self.directory = Path(root) / self.identity.hex()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[bytes, _File] = OrderedDict()  # key digest -> file, LRU first
        self._pending: list[tuple[Future, SegmentKey, _File]] = []
        self._doomed: set[bytes] = set()  # flushed while their write was under way
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hypic-disk-write")
        self.readers = readers or ThreadPoolExecutor(READERS, thread_name_prefix="hypic-disk-read")
        self._counts = dict.fromkeys(("hits", "misses", "promotions", "demotions", "evictions", "errors"), 0)
        self._scan()
        self.meter = ReadMeter()
        kept = kept_rates(self.rates_path).get(READ_RATE)
        self.probed = kept is None  # this engine measured the rate before its first read
        self._start_rate = kept or self._measure_read_rate()
        if self.probed:
            keep_rates(self.rates_path, **{READ_RATE: self._start_rate})

    @property
    def read_bytes_per_s(self) -> float:
        """Overall read throughput: this engine's reads' once there are any, else the one kept
        beside the files (or probed at start-up)."""
        return self.meter.bytes_per_s or self._start_rate

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

    def entry_bytes(self, key: SegmentKey) -> int | None:
        """The bytes of a stored entry (what reading it needs room for), or None on a miss."""
        return self._index[key.digest].nbytes if key in self else None

    def start_read(self, key: SegmentKey, dst: torch.Tensor) -> Future | None:
        """Read a stored entry into `dst` (uint8, `entry_bytes(key)` of them, untouched until the
        future is done) on a reader thread; finish with `finish_read`. None on a miss."""
        if key not in self:
            self._counts["misses"] += 1
            return None
        record = self._index[key.digest]
        if dst.dtype != torch.uint8 or dst.numel() != record.nbytes:
            raise ValueError(f"segment file {key.digest.hex()} holds {record.nbytes} bytes; its read was given "
                             f"{dst.numel()} of {dst.dtype}")
        return self.readers.submit(self._read_file, key.digest, record, dst)

    def finish_read(self, key: SegmentKey, read: Future) -> tuple[int, int] | None:
        """The interior of a finished read that passed every check (its bytes are in the read's
        `dst`), or None (a miss)."""
        if read.exception() is not None:
            self._drop(key.digest, error=True)
        if read.exception() is not None or key not in self:  # failed, or flushed meanwhile
            self._counts["misses"] += 1
            return None
        self._index.move_to_end(key.digest)
        self._counts["hits"] += 1
        self._counts["promotions"] += 1
        return self._index[key.digest].interior

    def close(self) -> None:
        """Wait for the writes and reads under way, stop the threads (an engine shutting down), and
        keep the read rate this engine measured for the next one."""
        self._writer.shutdown(wait=True)
        self.readers.shutdown(wait=True)
        self.reap()
        if self.meter.bytes_per_s is not None:
            keep_rates(self.rates_path, **{READ_RATE: self.meter.bytes_per_s})

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

    def _read_file(self, digest: bytes, record: _File, dst: torch.Tensor) -> None:
        """The entry's bytes into `dst`, checked (the reader thread)."""
        header, checksum = _read_payload(self._path(digest), dst, self.meter)
        if header != self._header(digest, record, checksum):
            raise ValueError(f"segment file {digest.hex()} fails its checksum or header")

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
        """Overall bytes per second of READERS freshly written files (dropped from the page cache
        where the OS allows) read at once, the way entries are read (into memory made beforehand,
        then the checksum), so that a slow disk is known before it is relied on."""
        probes = [self.directory / f"read-rate-{i}.probe" for i in range(READERS)]
        for probe in probes:
            _write_probe(probe)
        meter, buffers = ReadMeter(), [torch.empty(_PROBE_BYTES, dtype=torch.uint8) for _ in probes]
        with ThreadPoolExecutor(READERS, thread_name_prefix="hypic-disk-probe") as pool:
            list(pool.map(lambda pair: _read_payload(*pair, meter), zip(probes, buffers)))
        for probe in probes:
            probe.unlink()
        return meter.bytes_per_s


def _write_probe(path: Path) -> None:
    with open(path, "wb") as f:
        f.write(bytes(_HEADER.size) + os.urandom(_PROBE_BYTES))
        f.flush()
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read_payload(path: Path, dst: torch.Tensor, meter: ReadMeter) -> tuple[bytes, int]:
    """(header, payload checksum) of a file whose payload, after its header, is `dst.numel()` bytes:
    read straight into `dst` (no copies holding the GIL), the time it took counted by `meter`."""
    meter.started()
    read = 0
    try:
        with open(path, "rb") as f:
            header, read, rest = f.read(_HEADER.size), f.readinto(dst.numpy()), f.read(1)
        if len(header) < _HEADER.size or read != dst.numel() or rest:
            raise ValueError(f"segment file {path.name} is truncated")
        return header, xxhash.xxh3_64_intdigest(dst.numpy())
    finally:
        meter.finished(read)
