"""The public pool (DESIGN §1, §4): segment tuples in one preallocated arena with its own byte budget.

An entry is one PIC segment's tuple, stored contiguously at a 256-byte aligned offset:

    [T block    : n_lin x [HV, *t_shape]      t_dtype (float32 for log-gate families, else state dtype)]
    [S0 block   : n_lin x [HV, K, V]          state dtype (float32 or bfloat16)]
    [conv block : n_lin x [conv_dim, W - 1]   model dtype]
    [KV block   : L_int x n_full x 2 x [Hkv, D]  model dtype; K (before RoPE) then V per token/layer]

each block 256-byte aligned. Kernels read entries in place through flat views of the arena
(`t_src`, `s0_src`, `model_src`) and element offsets (`SegmentEntry.t_offset`, ...). Entries are
evicted least-recently-used first; `get` pins an entry until `unpin`, and a pinned entry is never
evicted nor overwritten. Single-threaded (the engine loop owns it).
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import xxhash

from hypic.cache.model_caches import CacheShape
from hypic.kernels.compose import CachedPieces
from hypic.kernels.linear_families import LinearFamily

ALIGN = 256  # bytes: every entry and block starts here, so any dtype view of the arena is aligned
STATE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class SegmentKey:
    """Content address of a segment: an edited segment is a new key, never a stale hit."""

    digest: bytes  # xxh3-128 of (model fingerprint, seam width, salt, token ids)
    salt: str | None  # kept in the clear so `flush(salt)` can find a tenant's entries

    @classmethod
    def of(cls, fingerprint: str, seam_width: int, salt: str | None, token_bytes: bytes) -> SegmentKey:
        """The key of a segment whose ids are `token_bytes` (hypic.cache.prefix_cache.token_bytes:
        a prompt converts its ids once, `SegmentedPrompt.segment_bytes`)."""
        h = xxhash.xxh3_128()
        for part in (fingerprint, str(seam_width), "" if salt is None else "=" + salt):
            h.update(part.encode())
            h.update(b"\x00")
        h.update(token_bytes)
        return cls(h.digest(), salt)


@dataclass(frozen=True)
class SegmentTuple:
    """What one PIC segment caches, as produced by its isolated prefill (inputs to `put`)."""

    interior: tuple[int, int]  # [start, end) token span of the segment the tuple covers
    T: Sequence[torch.Tensor]  # per linear layer [HV, *t_shape]
    S0: Sequence[torch.Tensor]  # per linear layer [HV, K, V], end state from zero
    conv_tail: Sequence[torch.Tensor]  # per linear layer [conv_dim, W-1]: pre-conv inputs [end-W+1, end)
    K: Sequence[torch.Tensor]  # per full layer [L_int, Hkv, D], after k_norm, before RoPE
    V: Sequence[torch.Tensor]  # per full layer [L_int, Hkv, D]

    @property
    def interior_len(self) -> int:
        return self.interior[1] - self.interior[0]


@dataclass(frozen=True)
class SegmentLayout:
    """Shapes, dtypes and byte offsets of one model's entries."""

    family: LinearFamily
    num_linear: int
    num_full: int
    value_heads: int  # HV
    key_dim: int  # K
    value_dim: int  # V
    conv_dim: int
    conv_kernel: int  # W
    kv_heads: int
    head_dim: int
    state_dtype: torch.dtype  # dense T and S0
    model_dtype: torch.dtype  # conv tails and KV

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"segment state dtype must be one of {STATE_DTYPES}, got {self.state_dtype}")

    @classmethod
    def from_cache_shape(cls, shape: CacheShape, family: LinearFamily, state_dtype: torch.dtype,
                         model_dtype: torch.dtype) -> SegmentLayout:
        return cls(family, len(shape.linear_layers), len(shape.full_layers), shape.linear_value_heads,
                   shape.linear_key_dim, shape.linear_value_dim, shape.conv_dim, shape.conv_kernel,
                   shape.num_kv_heads, shape.head_dim, state_dtype, model_dtype)

    @property
    def t_dtype(self) -> torch.dtype:
        return self.family.t_storage_dtype(self.state_dtype)

    @property
    def t_shape(self) -> tuple[int, ...]:
        return (self.value_heads, *self.family.t_shape(self.key_dim))

    @property
    def s0_shape(self) -> tuple[int, ...]:
        return (self.value_heads, self.key_dim, self.value_dim)

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def t_layer_stride(self) -> int:
        """Elements between consecutive linear layers' T blocks of an entry (`CachedPieces.shifted`)."""
        return math.prod(self.t_shape)

    @property
    def s0_layer_stride(self) -> int:
        """Elements between consecutive linear layers' S0 blocks of an entry."""
        return math.prod(self.s0_shape)

    @property
    def conv_layer_stride(self) -> int:
        """Elements between consecutive linear layers' conv tails of an entry."""
        return math.prod(self.conv_shape)

    @property
    def kv_token_stride(self) -> int:
        """Elements (model dtype) between consecutive tokens' K blocks of one layer."""
        return self.num_full * 2 * self.kv_heads * self.head_dim

    @property
    def kv_layer_stride(self) -> int:
        """Elements (model dtype) between one token's K blocks of consecutive full layers."""
        return 2 * self.kv_heads * self.head_dim

    def block_bytes(self, interior_len: int) -> tuple[int, int, int, int]:
        """Aligned bytes of the T, S0, conv and KV blocks of an entry."""
        n_lin, itemsize = self.num_linear, self.model_dtype.itemsize
        return (_align(n_lin * math.prod(self.t_shape) * self.t_dtype.itemsize),
                _align(n_lin * math.prod(self.s0_shape) * self.state_dtype.itemsize),
                _align(n_lin * math.prod(self.conv_shape) * itemsize),
                _align(interior_len * self.kv_token_stride * itemsize))

    def entry_bytes(self, interior_len: int) -> int:
        return sum(self.block_bytes(interior_len))


@dataclass(eq=False)
class SegmentEntry:
    """One stored tuple: typed views into the arena (no copies) and offsets for the kernels."""

    key: SegmentKey
    interior: tuple[int, int]
    offset: int  # bytes into the arena
    nbytes: int
    layout: SegmentLayout = field(repr=False)
    arena: torch.Tensor = field(repr=False)
    pins: int = 0

    @property
    def interior_len(self) -> int:
        return self.interior[1] - self.interior[0]

    @cached_property
    def _block_starts(self) -> tuple[int, ...]:
        """Arena byte offsets of the T, S0, conv and KV blocks. An entry never moves, and a step
        asks for them for every piece it composes: computed once."""
        return tuple(itertools.accumulate(self.layout.block_bytes(self.interior_len)[:-1], initial=self.offset))

    def _view(self, byte_offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        return self.arena[byte_offset: byte_offset + size].view(dtype).view(shape)

    def t_offset(self, linear_index: int) -> int:
        """Element offset of linear layer `linear_index`'s T block in `SegmentStore.t_src`."""
        return self._layer_offset(0, self.layout.t_dtype, self.layout.t_layer_stride, linear_index)

    def s0_offset(self, linear_index: int) -> int:
        """Element offset of linear layer `linear_index`'s S0 in `SegmentStore.s0_src`."""
        return self._layer_offset(1, self.layout.state_dtype, self.layout.s0_layer_stride, linear_index)

    def conv_offset(self, linear_index: int) -> int:
        """Element offset of linear layer `linear_index`'s conv tail [conv_dim, W-1] in `SegmentStore.model_src`."""
        return self._layer_offset(2, self.layout.model_dtype, self.layout.conv_layer_stride, linear_index)

    def kv_offset(self, full_index: int, token: int = 0) -> int:
        """Element offset of interior token `token`'s K block of full layer `full_index` in
        `SegmentStore.model_src` (its V block follows right after, as `scatter_kv` expects)."""
        base = self._block_starts[3] // self.layout.model_dtype.itemsize
        return base + token * self.layout.kv_token_stride + full_index * self.layout.kv_layer_stride

    def T(self, linear_index: int) -> torch.Tensor:
        return self._layer_view(0, self.layout.t_dtype, self.layout.t_shape, linear_index)

    def S0(self, linear_index: int) -> torch.Tensor:
        return self._layer_view(1, self.layout.state_dtype, self.layout.s0_shape, linear_index)

    def conv_tail(self, linear_index: int) -> torch.Tensor:
        return self._layer_view(2, self.layout.model_dtype, self.layout.conv_shape, linear_index)

    def _layer_offset(self, block: int, dtype: torch.dtype, layer_stride: int, linear_index: int) -> int:
        """Element offset of one linear layer's part of a per-linear-layer block (T, S0 or conv tails)."""
        return self._block_starts[block] // dtype.itemsize + linear_index * layer_stride

    def _layer_view(self, block: int, dtype: torch.dtype, shape: tuple[int, ...], linear_index: int) -> torch.Tensor:
        """One linear layer's part of a per-linear-layer block, as a tensor of `shape`."""
        return self._view(self._block_starts[block], dtype, (self.layout.num_linear, *shape))[linear_index]

    def _kv(self) -> torch.Tensor:
        lay = self.layout
        shape = (self.interior_len, lay.num_full, 2, lay.kv_heads, lay.head_dim)
        return self._view(self._block_starts[3], lay.model_dtype, shape)

    def K(self, full_index: int) -> torch.Tensor:
        """[L_int, Hkv, D] before RoPE (a strided view)."""
        return self._kv()[:, full_index, 0]

    def V(self, full_index: int) -> torch.Tensor:
        return self._kv()[:, full_index, 1]


@dataclass(frozen=True)
class SegmentStoreStats:
    entries: int
    bytes: int  # bytes held by entries (flushed-but-pinned ones included)
    capacity_bytes: int
    pinned: int
    hits: int
    misses: int
    evictions: int


class SegmentStore:
    """LRU, pinning, byte-budgeted store of segment tuples over one preallocated arena."""

    def __init__(self, layout: SegmentLayout, capacity_bytes: int, device: torch.device | str) -> None:
        self.layout = layout
        self.capacity_bytes = capacity_bytes // ALIGN * ALIGN
        # past the budget, an all-zero tuple that is never evicted: composing it keeps any state
        # finite (dense T = 0, log-gate T = 0), so padding rows of a CUDA graph may compose it
        zero_bytes = layout.entry_bytes(0)
        self._arena = torch.zeros(self.capacity_bytes + zero_bytes, dtype=torch.uint8, device=device)
        self.zero_entry = SegmentEntry(SegmentKey(bytes(16), None), (0, 0), self.capacity_bytes, zero_bytes,
                                       layout, self._arena)
        # offset of each channel within a stored conv tail [conv_dim, W-1], for gathering tails in place
        self.conv_channels = torch.arange(layout.conv_dim, device=device) * (layout.conv_kernel - 1)
        self._free = _FreeList(self.capacity_bytes)
        self._index: OrderedDict[SegmentKey, SegmentEntry] = OrderedDict()  # LRU first
        self._flushed: list[SegmentEntry] = []  # removed from the index, still pinned
        self._hits = self._misses = self._evictions = 0

    # flat views for the kernels (zero-copy; element offsets come from SegmentEntry)
    @property
    def t_src(self) -> torch.Tensor:
        return self._arena.view(self.layout.t_dtype)

    @property
    def s0_src(self) -> torch.Tensor:
        return self._arena.view(self.layout.state_dtype)

    @property
    def model_src(self) -> torch.Tensor:
        """Conv tails and K/V (both in the model dtype)."""
        return self._arena.view(self.layout.model_dtype)

    def layer_pieces(self, pieces: CachedPieces, linear_index: int) -> CachedPieces:
        """A step's piece table (offsets of linear layer 0) at linear layer `linear_index`."""
        lay = self.layout
        return pieces.shifted(linear_index * lay.t_layer_stride, linear_index * lay.s0_layer_stride)

    def conv_tails(self, tail_offsets: torch.Tensor, linear_index: int) -> torch.Tensor:
        """[P*(W-1), conv_dim]: the stored conv-tail rows at `tail_offsets` (of linear layer 0, one
        per (piece, tap)) at linear layer `linear_index`, gathered in place."""
        rows = tail_offsets + linear_index * self.layout.conv_layer_stride
        return self.model_src[rows[:, None] + self.conv_channels[None, :]]

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self._index

    def get(self, key: SegmentKey) -> SegmentEntry | None:
        """The entry, pinned (call `unpin` when done), or None on a miss."""
        entry = self._index.get(key)
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        self._index.move_to_end(key)
        entry.pins += 1
        return entry

    def put(self, key: SegmentKey, tup: SegmentTuple) -> bool:
        """Copy a tuple in (converting dtypes). True if stored or already present; False when it
        cannot fit even after evicting every unpinned entry. Does not pin."""
        if key in self._index:
            self._index.move_to_end(key)
            return True
        self._check(tup)
        nbytes = self.layout.entry_bytes(tup.interior_len)
        offset = self._allocate(nbytes)
        if offset is None:
            return False
        entry = SegmentEntry(key, tup.interior, offset, nbytes, self.layout, self._arena)
        self._write(entry, tup)
        self._index[key] = entry
        return True

    def unpin(self, entry: SegmentEntry) -> None:
        """Release one `get`. A flushed entry is freed with its last pin."""
        if entry.pins <= 0:
            raise ValueError(f"segment entry at offset {entry.offset} is not pinned")
        entry.pins -= 1
        if entry.pins == 0 and entry in self._flushed:
            self._flushed.remove(entry)
            self._free.release(entry.offset, entry.nbytes)

    def flush(self, salt: str | None = None) -> int:
        """Drop every entry (of one salt when given): no later hit; pinned ones are freed on unpin.
        Returns the number of entries dropped."""
        doomed = [key for key in self._index if salt is None or key.salt == salt]
        for key in doomed:
            entry = self._index.pop(key)
            if entry.pins:
                self._flushed.append(entry)
            else:
                self._free.release(entry.offset, entry.nbytes)
        return len(doomed)

    def stats(self) -> SegmentStoreStats:
        pinned = sum(1 for e in self._index.values() if e.pins) + len(self._flushed)
        return SegmentStoreStats(len(self._index), self.capacity_bytes - self._free.free_bytes,
                                 self.capacity_bytes, pinned, self._hits, self._misses, self._evictions)

    def _allocate(self, nbytes: int) -> int | None:
        """First-fit; evicts least-recently-used unpinned entries until a hole fits."""
        pinned_bytes = sum(e.nbytes for e in self._index.values() if e.pins)
        pinned_bytes += sum(e.nbytes for e in self._flushed)
        if nbytes > self.capacity_bytes - pinned_bytes:
            return None  # hopeless: evicting would only lose entries
        offset = self._free.allocate(nbytes)
        while offset is None and self._evict_one():
            offset = self._free.allocate(nbytes)
        return offset

    def _evict_one(self) -> bool:
        victim = next((key for key, e in self._index.items() if not e.pins), None)
        if victim is None:
            return False
        entry = self._index.pop(victim)
        self._free.release(entry.offset, entry.nbytes)
        self._evictions += 1
        return True

    def _write(self, entry: SegmentEntry, tup: SegmentTuple) -> None:
        for i in range(self.layout.num_linear):
            entry.T(i).copy_(tup.T[i])
            entry.S0(i).copy_(tup.S0[i])
            entry.conv_tail(i).copy_(tup.conv_tail[i])
        for j in range(self.layout.num_full):
            entry.K(j).copy_(tup.K[j])
            entry.V(j).copy_(tup.V[j])

    def _check(self, tup: SegmentTuple) -> None:
        lay = self.layout
        kv_shape = (tup.interior_len, lay.kv_heads, lay.head_dim)
        expected = {"T": (lay.num_linear, lay.t_shape), "S0": (lay.num_linear, lay.s0_shape),
                    "conv_tail": (lay.num_linear, lay.conv_shape), "K": (lay.num_full, kv_shape),
                    "V": (lay.num_full, kv_shape)}
        for name, (count, shape) in expected.items():
            parts = getattr(tup, name)
            if len(parts) != count or any(tuple(p.shape) != shape for p in parts):
                got = [tuple(p.shape) for p in parts]
                raise ValueError(f"segment tuple {name}: expected {count} x {shape}, got {got}")


class _FreeList:
    """Holes of the arena as sorted (offset, size) pairs; adjacent holes are merged on release."""

    def __init__(self, capacity: int) -> None:
        self._holes: list[tuple[int, int]] = [(0, capacity)] if capacity else []

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._holes)

    def allocate(self, nbytes: int) -> int | None:
        for i, (offset, size) in enumerate(self._holes):
            if size >= nbytes:
                self._holes[i: i + 1] = [(offset + nbytes, size - nbytes)] if size > nbytes else []
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        i = next((i for i, (o, _) in enumerate(self._holes) if o > offset), len(self._holes))
        self._holes.insert(i, (offset, nbytes))
        if i + 1 < len(self._holes) and offset + nbytes == self._holes[i + 1][0]:
            self._holes[i: i + 2] = [(offset, nbytes + self._holes[i + 1][1])]
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == offset:
            self._holes[i - 1: i + 1] = [(self._holes[i - 1][0], self._holes[i - 1][1] + self._holes[i][1])]


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
