"""The public pool (DESIGN §1, §4): segment tuples in one preallocated arena with its own byte budget.

An entry is one PIC segment's tuple, stored contiguously at a 256-byte aligned offset:

    [T block    : n_lin x [HV, *t_shape]      t_dtype (float32 for log-gate families, else state dtype)]
    [S0 block   : n_lin x [HV, K, V]          state dtype (float32 or bfloat16)]
    [conv block : n_lin x [conv_dim, W - 1]   model dtype]
    [KV block   : L_int x n_full x kv x [Hkv, D]  model dtype; K (before RoPE) then V per token/layer,
                                                   or kv = 1: the one latent row (MLA) that is both]

each block 256-byte aligned. Kernels read entries in place through flat views of the arena
(`t_src`, `s0_src`, `model_src`) and element offsets (`SegmentEntry.t_offset`, ...). Entries are
evicted least-recently-used first; `get` pins an entry until `unpin`, and a pinned entry is never
evicted nor overwritten. With lower tiers (`hypic.cache.tiers`), an evicted entry is demoted as
opaque bytes, and a miss the lower tiers hold is promoted back. Single-threaded (the engine loop owns it).
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import xxhash

from hypic.cache.model_caches import CacheShape, LinearShape
from hypic.kernels.compose import CachedPieces
from hypic.kernels.host_copy import host_to_device

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
    """Shapes, dtypes and byte offsets of one model's entries. Each per-linear-layer block holds the
    layers' parts one after another, each in its layer's own shape; a part starts 256-byte aligned
    where the family changes (so a dense T after a log-gate one keeps its 16-element alignment)."""

    linear: tuple[LinearShape, ...]  # per linear layer: family, state and conv shapes
    num_full: int
    kv_heads: int
    head_dim: int
    state_dtype: torch.dtype  # dense T and S0
    model_dtype: torch.dtype  # conv tails and KV
    kv_tensors: int = 2  # K and V per token and full layer, or 1 (MLA: the latent is both)

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"segment state dtype must be one of {STATE_DTYPES}, got {self.state_dtype}")

    @classmethod
    def from_cache_shape(cls, shape: CacheShape, state_dtype: torch.dtype, model_dtype: torch.dtype) -> SegmentLayout:
        return cls(shape.linear, len(shape.full_layers), shape.num_kv_heads, shape.head_dim, state_dtype, model_dtype,
                   shape.kv_tensors)

    @property
    def num_linear(self) -> int:
        return len(self.linear)

    @property
    def conv_kernel(self) -> int:
        """W, the same at every linear layer (`CacheShape` checks)."""
        return self.linear[0].conv_kernel if self.linear else 1

    def t_dtype(self, linear_index: int) -> torch.dtype:
        return self.linear[linear_index].family.t_storage_dtype(self.state_dtype)

    def t_shape(self, linear_index: int) -> tuple[int, ...]:
        s = self.linear[linear_index]
        return (s.value_heads, *s.family.t_shape(s.key_dim))

    def s0_shape(self, linear_index: int) -> tuple[int, ...]:
        return self.linear[linear_index].state_shape

    def conv_shape(self, linear_index: int) -> tuple[int, ...]:
        return self.linear[linear_index].conv_state_shape

    def block_dtype(self, block: int, linear_index: int) -> torch.dtype:
        """Dtype of one linear layer's part of block 0 (T), 1 (S0) or 2 (conv tails)."""
        return (self.t_dtype(linear_index), self.state_dtype, self.model_dtype)[block]

    def block_shape(self, block: int, linear_index: int) -> tuple[int, ...]:
        return (self.t_shape, self.s0_shape, self.conv_shape)[block](linear_index)

    @cached_property
    def _parts(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """Per block (T, S0, conv): the byte offset of each linear layer's part, and the block's bytes."""
        return tuple(self._pack(block) for block in range(3))

    def _pack(self, block: int) -> tuple[tuple[int, ...], int]:
        offsets, cursor = [], 0
        for i, shape in enumerate(self.linear):
            if i and shape.family is not self.linear[i - 1].family:
                cursor = _align(cursor)
            offsets.append(cursor)
            cursor += math.prod(self.block_shape(block, i)) * self.block_dtype(block, i).itemsize
        return tuple(offsets), _align(cursor)

    def part_offset(self, block: int, linear_index: int) -> int:
        """Byte offset of linear layer `linear_index`'s part within block `block` of an entry."""
        return self._parts[block][0][linear_index]

    @property
    def kv_token_stride(self) -> int:
        """Elements (model dtype) between consecutive tokens' K blocks of one layer."""
        return self.num_full * self.kv_layer_stride

    @property
    def kv_layer_stride(self) -> int:
        """Elements (model dtype) between one token's K blocks of consecutive full layers."""
        return self.kv_tensors * self.kv_heads * self.head_dim

    @property
    def v_offset(self) -> int:
        """Elements from a token's K block to its V block (0: the same rows)."""
        return (self.kv_tensors - 1) * self.kv_heads * self.head_dim

    def block_bytes(self, interior_len: int) -> tuple[int, int, int, int]:
        """Aligned bytes of the T, S0, conv and KV blocks of an entry."""
        kv = _align(interior_len * self.kv_token_stride * self.model_dtype.itemsize)
        return (self._parts[0][1], self._parts[1][1], self._parts[2][1], kv)

    def entry_bytes(self, interior_len: int) -> int:
        return sum(self.block_bytes(interior_len))

    @property
    def fixed_bytes(self) -> int:
        """Bytes of an entry's T, S0 and conv blocks, its first three (the same at any interior length):
        where its KV block starts."""
        return self._block_starts[3]

    def part_byte(self, block: int, linear_index: int) -> int:
        """Byte offset within an entry of linear layer `linear_index`'s part of block 0 (T), 1 (S0) or
        2 (conv)."""
        return self._block_starts[block] + self.part_offset(block, linear_index)

    @cached_property
    def _block_starts(self) -> tuple[int, ...]:
        """Byte offsets within an entry of its T, S0, conv and KV blocks: the same for every entry (a
        step asks for them for every piece it composes: computed once)."""
        return tuple(itertools.accumulate(self.block_bytes(0)[:3], initial=0))


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
    source: str = "pool"  # where its last `get` found it: "pool", or the lower tier it was promoted from
    ready: torch.cuda.Event | None = field(default=None, repr=False)  # the promotion copy still filling it

    @property
    def landed(self) -> bool:
        """Its bytes are in place (a promotion copy on a side stream may still be filling them)."""
        return self.ready is None or self.ready.query()

    @property
    def interior_len(self) -> int:
        return self.interior[1] - self.interior[0]

    def t_offset(self, linear_index: int) -> int:
        """Element offset of linear layer `linear_index`'s T block in `SegmentStore.t_src(linear_index)`."""
        return self._part_offset(0, linear_index)

    def s0_offset(self, linear_index: int) -> int:
        """Element offset of linear layer `linear_index`'s S0 in `SegmentStore.s0_src`."""
        return self._part_offset(1, linear_index)

    def conv_offset(self, linear_index: int) -> int:
        """Element offset of linear layer `linear_index`'s conv tail [conv_dim, W-1] in `SegmentStore.model_src`."""
        return self._part_offset(2, linear_index)

    def kv_offset(self, full_index: int, token: int = 0) -> int:
        """Element offset of interior token `token`'s K block of full layer `full_index` in
        `SegmentStore.model_src` (its V block follows right after, as `scatter_kv` expects)."""
        base = (self.offset + self.layout.fixed_bytes) // self.layout.model_dtype.itemsize
        return base + token * self.layout.kv_token_stride + full_index * self.layout.kv_layer_stride

    def tail_offsets(self) -> list[int]:
        """Element offsets in `SegmentStore.model_src` of linear layer 0's conv-tail taps (W-1 of them),
        the rows `SegmentStore.conv_tails` gathers at any layer."""
        return [self.conv_offset(0) + tap for tap in range(self.layout.conv_kernel - 1)]

    def views(self) -> SegmentTuple:
        """The stored tuple as views into the arena (valid while the entry is pinned)."""
        lin, full = range(self.layout.num_linear), range(self.layout.num_full)
        values = full if self.layout.kv_tensors == 2 else ()
        return SegmentTuple(self.interior, [self.T(i) for i in lin], [self.S0(i) for i in lin],
                            [self.conv_tail(i) for i in lin], [self.K(j) for j in full], [self.V(j) for j in values])

    def T(self, linear_index: int) -> torch.Tensor:
        return self._part(0, linear_index)

    def S0(self, linear_index: int) -> torch.Tensor:
        return self._part(1, linear_index)

    def conv_tail(self, linear_index: int) -> torch.Tensor:
        return self._part(2, linear_index)

    def _part_byte(self, block: int, linear_index: int) -> int:
        return self.offset + self.layout.part_byte(block, linear_index)

    def _part_offset(self, block: int, linear_index: int) -> int:
        """Element offset (in the part's dtype) of one linear layer's part of block T, S0 or conv."""
        return self._part_byte(block, linear_index) // self.layout.block_dtype(block, linear_index).itemsize

    def _part(self, block: int, linear_index: int) -> torch.Tensor:
        """One linear layer's part of a per-linear-layer block, as a tensor of its shape."""
        lay = self.layout
        return _view(self.arena, self._part_byte(block, linear_index), lay.block_dtype(block, linear_index),
                     lay.block_shape(block, linear_index))

    def kv_rows(self) -> torch.Tensor:
        """[L_int, n_full, kv, Hkv, D]: every interior token's K (and V) of every full layer."""
        lay = self.layout
        shape = (self.interior_len, lay.num_full, lay.kv_tensors, lay.kv_heads, lay.head_dim)
        return _view(self.arena, self.offset + lay.fixed_bytes, lay.model_dtype, shape)

    def K(self, full_index: int) -> torch.Tensor:
        """[L_int, Hkv, D] before RoPE (a strided view)."""
        return self.kv_rows()[:, full_index, 0]

    def V(self, full_index: int) -> torch.Tensor:
        return self.kv_rows()[:, full_index, 1]


class TupleStaging:
    """Cold segments' tuples as a step captures them, in the pool's layout and dtypes: each layer writes
    its part of every segment that ends in the step at once (a strided view over them), and storing one
    is then two copies (`SegmentStore.put_staged`) rather than one per part and layer.

    fixed [E, fixed_bytes]: the T, S0 and conv blocks of each ending segment, laid out as an entry's;
    kv [R, n_full, kv, Hkv, D]: each full layer's K (and V) of every interior row of the step, in order."""

    def __init__(self, layout: SegmentLayout, ending: int, rows: int, device: torch.device | str) -> None:
        self.layout = layout
        self.fixed = torch.empty(ending, layout.fixed_bytes, dtype=torch.uint8, device=device)
        self.kv = torch.empty(rows, layout.num_full, layout.kv_tensors, layout.kv_heads, layout.head_dim,
                              dtype=layout.model_dtype, device=device)

    def rows(self, start: int, end: int, *, copy: bool = False) -> TupleStaging:
        """The staging over K/V rows [start, end) only (a padded captured step's interior); `copy`: a copy
        of it (a replay's, which the next one overwrites), else a view."""
        view = TupleStaging.__new__(TupleStaging)
        view.layout, view.fixed, view.kv = self.layout, self.fixed, self.kv[start:end]
        if copy:
            view.fixed, view.kv = view.fixed.clone(), view.kv.clone()
        return view

    def part(self, block: int, linear_index: int) -> torch.Tensor:
        """[E, *shape]: linear layer `linear_index`'s part of block 0 (T), 1 (S0) or 2 (conv tail) of
        every ending segment."""
        lay = self.layout
        dtype, shape = lay.block_dtype(block, linear_index), lay.block_shape(block, linear_index)
        start = lay.part_byte(block, linear_index)
        size = math.prod(shape) * dtype.itemsize
        return self.fixed[:, start:start + size].view(dtype).view(self.fixed.shape[0], *shape)


@dataclass(frozen=True)
class SegmentStoreStats:
    entries: int
    bytes: int  # bytes held by entries (flushed-but-pinned ones included)
    capacity_bytes: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    promotions: int = 0  # misses served by a lower tier
    demotions: int = 0  # evictions copied down to a lower tier
    no_room: int = 0  # promotions and stores refused because pinned entries held the pool (recomputed)


class SegmentStore:
    """LRU, pinning, byte-budgeted store of segment tuples over one preallocated arena."""

    def __init__(self, layout: SegmentLayout, capacity_bytes: int, device: torch.device | str,
                 lower: LowerTiers | None = None) -> None:  # noqa: F821 (hypic.cache.tiers imports this module)
        self.layout, self.lower = layout, lower
        self.capacity_bytes = capacity_bytes // ALIGN * ALIGN
        # past the budget, an all-zero tuple that is never evicted: composing it keeps any state
        # finite (dense T = 0, log-gate T = 0), so padding rows of a CUDA graph may compose it
        zero_bytes = layout.entry_bytes(0)
        self._arena = torch.zeros(self.capacity_bytes + zero_bytes, dtype=torch.uint8, device=device)
        self.zero_entry = SegmentEntry(SegmentKey(bytes(16), None), (0, 0), self.capacity_bytes, zero_bytes,
                                       layout, self._arena)
        # offset of each channel within a stored conv tail [conv_dim, W-1], for gathering tails in place
        self._conv_channels = {dim: torch.arange(dim, device=device) * (layout.conv_kernel - 1)
                               for dim in {s.conv_dim for s in layout.linear}}
        self._free = FreeList(self.capacity_bytes)
        self._index: OrderedDict[SegmentKey, SegmentEntry] = OrderedDict()  # LRU first
        self._flushed: list[SegmentEntry] = []  # removed from the index, still pinned
        # evicted entries whose demotion copy may still read them: their space is reused once it lands
        self._draining: list[tuple[SegmentEntry, torch.cuda.Event]] = []
        self._hits = self._misses = self._evictions = self._promotions = self._demotions = self._no_room = 0
        self._moved: set[SegmentKey] = set()  # keys whose best tier changed since `take_moves`

    # flat views for the kernels (zero-copy; element offsets come from SegmentEntry)
    def t_src(self, linear_index: int) -> torch.Tensor:
        """The arena in linear layer `linear_index`'s T dtype."""
        return self._arena.view(self.layout.t_dtype(linear_index))

    @property
    def s0_src(self) -> torch.Tensor:
        return self._arena.view(self.layout.state_dtype)

    @property
    def model_src(self) -> torch.Tensor:
        """Conv tails and K/V (both in the model dtype)."""
        return self._arena.view(self.layout.model_dtype)

    def layer_pieces(self, pieces: CachedPieces, linear_index: int) -> CachedPieces:
        """A step's piece table (element offsets of linear layer 0) at linear layer `linear_index`:
        every entry's blocks are laid out alike, so a layer's offsets are layer 0's moved by one
        amount (rescaled first where the layer's T dtype has another size)."""
        if linear_index == 0:
            return pieces
        lay = self.layout
        t_from, t_to = lay.t_dtype(0).itemsize, lay.t_dtype(linear_index).itemsize
        if t_from != t_to:
            pieces = CachedPieces(pieces.ptr, pieces.at, pieces.t_off * t_from // t_to, pieces.s0_off)
        return pieces.shifted(lay.part_offset(0, linear_index) // t_to,
                              lay.part_offset(1, linear_index) // lay.state_dtype.itemsize)

    def conv_tails(self, tail_offsets: torch.Tensor, linear_index: int) -> torch.Tensor:
        """[P*(W-1), conv_dim]: the stored conv-tail rows at `tail_offsets` (of linear layer 0, one
        per (piece, tap)) at linear layer `linear_index`, gathered in place (tensor offsets, not a
        list of views, so a CUDA graph can replay it for other pieces)."""
        shift = self.layout.part_offset(2, linear_index) // self.layout.model_dtype.itemsize
        rows = tail_offsets + shift if shift else tail_offsets
        return self.model_src[rows[:, None] + self.conv_channels(linear_index)[None, :]]

    def interior_kv_offsets(self, pieces: Sequence[tuple[int, SegmentEntry]],
                            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[M] global position and [M] `model_src` offset (K of full layer 0) of every interior token
        of `pieces` ((global position of the first, entry) pairs), in order. The host sends one row
        per piece, not per token: building and copying 16k-token index tensors on the host grew its
        time with every cached segment."""
        lengths = [entry.interior_len for _, entry in pieces]
        rows = host_to_device([[first, entry.kv_offset(0), start, length] for (first, entry), start, length
                               in zip(pieces, itertools.accumulate(lengths, initial=0), lengths)], torch.long, device)
        total = sum(lengths)
        piece = torch.repeat_interleave(rows[:, 3], output_size=total)
        first_position, first_src, first_row, _ = rows[piece].unbind(1)
        within = torch.arange(total, device=device) - first_row  # token index inside its piece
        return first_position + within, first_src + within * self.layout.kv_token_stride

    def kv_at_layer(self, offsets: torch.Tensor, full_index: int) -> torch.Tensor:
        """`model_src` offsets of full layer 0's K blocks moved to full layer `full_index`'s."""
        return offsets + full_index * self.layout.kv_layer_stride

    def conv_channels(self, linear_index: int) -> torch.Tensor:
        """[conv_dim] element offset of each channel within a stored conv tail of that layer."""
        return self._conv_channels[self.layout.linear[linear_index].conv_dim]

    def __contains__(self, key: SegmentKey) -> bool:
        """Held by the pool or a tier below it."""
        return key in self._index or (self.lower is not None and key in self.lower)

    def tier(self, key: SegmentKey) -> str | None:
        """The best tier holding `key`: "pool", "host", "disk", or None."""
        if key in self._index:
            return "pool"
        return self.lower.tier(key) if self.lower is not None else None

    def take_moves(self) -> dict[SegmentKey, str | None]:
        """Each key whose best tier changed since the last call, with its tier now (None: gone);
        what a cluster's segment directory learns from."""
        moved = self._moved | (self.lower.take_moved() if self.lower is not None else set())
        self._moved = set()
        return {key: self.tier(key) for key in moved}

    def get(self, key: SegmentKey) -> SegmentEntry | None:
        """The entry, pinned (call `unpin` when done), promoted from a lower tier if need be; None
        on a miss. `entry.source` says which tier it came from."""
        entry = self._index.get(key)
        if entry is not None:
            self._hits += 1
            entry.source = "pool"
        else:
            self._misses += 1
            entry = self._promote(key)
            if entry is None:
                return None
        self._index.move_to_end(key)
        entry.pins += 1
        return entry

    def start_read(self, key: SegmentKey) -> bool:
        """Start promoting an entry only the disk tier holds: True while its read is under way
        (off the engine thread); once `finished_reads` lists it, `get` promotes it."""
        return self.lower is not None and self.lower.start_read(key)

    def finished_reads(self) -> list[SegmentKey]:
        return self.lower.finished_reads() if self.lower is not None else []

    def _promote(self, key: SegmentKey) -> SegmentEntry | None:
        claim = self.lower.claim(key) if self.lower is not None else None
        if claim is None:
            return None
        offset = self._allocate(claim.nbytes)
        if offset is None:  # pinned entries leave no room: the request recomputes rather than waits
            self.lower.release(claim)
            self._no_room += 1
            return None
        entry = SegmentEntry(key, claim.interior, offset, claim.nbytes, self.layout, self._arena, source=claim.tier)
        entry.ready = self.lower.copy_up(claim, self._bytes(entry))
        self._index[key] = entry
        self._moved.add(key)
        self._promotions += 1
        return entry

    def put(self, key: SegmentKey, tup: SegmentTuple) -> bool:
        """Copy a tuple in (converting dtypes). True if stored or already present; False when it
        cannot fit even after evicting every unpinned entry. Does not pin."""
        self._check(tup)
        return self._store(key, tup.interior, lambda entry: self._write(entry, tup))

    def put_staged(self, key: SegmentKey, interior: tuple[int, int], fixed: torch.Tensor,
                   kv_rows: Sequence[torch.Tensor]) -> bool:
        """`put` of a tuple a step captured into a `TupleStaging`: `fixed` its row of `staging.fixed`,
        `kv_rows` its K/V rows ([n, n_full, kv, Hkv, D], in interior order: a part per chunk). Two
        copies for a one-chunk tuple, whatever the number of layers."""
        rows = sum(part.shape[0] for part in kv_rows)
        if rows != interior[1] - interior[0] or fixed.numel() != self.layout.fixed_bytes:
            raise ValueError(f"staged tuple of interior {interior}: {rows} K/V rows, {fixed.numel()} bytes of "
                             f"T, S0 and conv blocks (expected {self.layout.fixed_bytes})")
        return self._store(key, interior, lambda entry: self._write_staged(entry, fixed, kv_rows))

    def _store(self, key: SegmentKey, interior: tuple[int, int], write) -> bool:
        if key in self._index:
            self._index.move_to_end(key)
            return True
        nbytes = self.layout.entry_bytes(interior[1] - interior[0])
        offset = self._allocate(nbytes)
        if offset is None:
            self._no_room += 1
            return False
        entry = SegmentEntry(key, interior, offset, nbytes, self.layout, self._arena)
        write(entry)
        self._index[key] = entry
        self._moved.add(key)
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
        """Drop every entry (of one salt when given), in every tier: no later hit; pinned ones are
        freed on unpin. Returns the number of entries dropped (a key in two tiers counts twice)."""
        dropped = drop_salt(self._index, self._flushed, self._free, salt)
        return dropped + (self.lower.flush(salt) if self.lower is not None else 0)

    def pinned(self, key: SegmentKey) -> bool:
        """In the pool and held there by a pin."""
        entry = self._index.get(key)
        return entry is not None and entry.pins > 0

    @property
    def room_bytes(self) -> int:
        """What pinned entries leave of the pool: the most that promotions and stores can take
        (free space, or entries they may evict)."""
        return self.capacity_bytes - sum(e.nbytes for e in self._held())

    def stats(self) -> SegmentStoreStats:
        return SegmentStoreStats(len(self._index), self.capacity_bytes - self._free.free_bytes,
                                 self.capacity_bytes, sum(1 for _ in self._held()), self._hits, self._misses, self._evictions,
                                 self._promotions, self._demotions, self._no_room)

    def _held(self) -> Iterator[SegmentEntry]:
        """The entries pins hold in the pool: indexed ones pinned, and flushed ones (pinned until unpinned)."""
        return itertools.chain((e for e in self._index.values() if e.pins), self._flushed)

    def _allocate(self, nbytes: int) -> int | None:
        """First-fit; when no hole fits, the run of the arena that costs least to free is evicted
        (`eviction_window`: not every older entry scattered over the arena). The space of entries
        whose demotion copy is under way is waited for on the device, not by the host."""
        if nbytes > self.room_bytes:
            return None  # hopeless: evicting would only lose entries
        self._release_drained(lambda event: event.query())
        offset = self._free.allocate(nbytes)
        if offset is None and self._evict_window(nbytes):
            offset = self._free.allocate(nbytes)
        return offset

    def _evict_window(self, nbytes: int) -> bool:
        """Evict the entries of the cheapest window of `nbytes` (False: pins leave none). Entries
        whose demotion is under way cost nothing more; pinned and flushed ones cannot go."""
        occupied = [(e.offset, e.nbytes, None if e.pins else rank, e) for rank, e in enumerate(self._index.values(), 1)]
        occupied += [(e.offset, e.nbytes, 0, e) for e, _ in self._draining]
        occupied += [(e.offset, e.nbytes, None, e) for e in self._flushed]
        doomed = window_to_evict(self._free.holes, occupied, nbytes)
        if doomed is None:
            return False
        for entry in doomed:
            if self._index.get(entry.key) is entry:  # else its demotion is already under way
                self._evict(self._index.pop(entry.key))
        self._release_drained(self._wait_on_device, among=set(doomed))
        return True

    def _evict(self, entry: SegmentEntry) -> None:
        self._evictions += 1
        self._moved.add(entry.key)
        copying = self.lower.demote(entry.key, entry.interior, self._bytes(entry)) if self.lower is not None else None
        self._demotions += self.lower is not None and entry.key in self.lower
        if copying is None:
            self._free.release(entry.offset, entry.nbytes)
        else:
            self._draining.append((entry, copying))

    def _release_drained(self, landed, among: set[SegmentEntry] | None = None) -> bool:
        """Free the space of evicted entries (those `among`, if given) whose demotion
        copy `landed(event)` says is done."""
        done = [(entry, event) for entry, event in self._draining
                if (among is None or entry in among) and landed(event)]
        self._draining = [item for item in self._draining if all(item[0] is not e for e, _ in done)]
        for entry, _ in done:
            self._free.release(entry.offset, entry.nbytes)
        return bool(done)

    @staticmethod
    def _wait_on_device(event: torch.cuda.Event) -> bool:
        """Out of room but for copies in flight: the engine's stream (not the host) waits for them."""
        torch.cuda.current_stream().wait_event(event)
        return True

    def _bytes(self, entry: SegmentEntry) -> torch.Tensor:
        return self._arena[entry.offset: entry.offset + entry.nbytes]

    @staticmethod
    def _write(entry: SegmentEntry, tup: SegmentTuple) -> None:
        stored = entry.views()
        for name in ("T", "S0", "conv_tail", "K", "V"):
            for dst, src in zip(getattr(stored, name), getattr(tup, name)):
                dst.copy_(src)

    def _write_staged(self, entry: SegmentEntry, fixed: torch.Tensor, kv_rows: Sequence[torch.Tensor]) -> None:
        self._bytes(entry)[:fixed.numel()].copy_(fixed)
        kv, row = entry.kv_rows(), 0
        for part in kv_rows:
            kv[row:row + part.shape[0]].copy_(part)
            row += part.shape[0]

    def _check(self, tup: SegmentTuple) -> None:
        lay = self.layout
        kv_shape = (tup.interior_len, lay.kv_heads, lay.head_dim)
        linear = range(lay.num_linear)
        expected = {"T": [lay.t_shape(i) for i in linear], "S0": [lay.s0_shape(i) for i in linear],
                    "conv_tail": [lay.conv_shape(i) for i in linear], "K": [kv_shape] * lay.num_full,
                    "V": [kv_shape] * (lay.num_full if lay.kv_tensors == 2 else 0)}
        for name, shapes in expected.items():
            got = [tuple(p.shape) for p in getattr(tup, name)]
            if got != shapes:
                raise ValueError(f"segment tuple {name}: expected {shapes}, got {got}")


def drop_salt(index: OrderedDict, flushed: list, free: FreeList, salt: str | None) -> int:
    """Drop an arena's entries of one salt (all when None) from its `index`: pinned ones wait in
    `flushed` for their last unpin, the others' bytes are freed now. Returns how many were dropped."""
    doomed = [key for key in index if salt is None or key.salt == salt]
    for key in doomed:
        entry = index.pop(key)
        if entry.pins:
            flushed.append(entry)
        else:
            free.release(entry.offset, entry.nbytes)
    return len(doomed)


def window_to_evict(holes: Sequence[tuple[int, int]], occupied: Sequence[tuple], nbytes: int) -> list[Any] | None:
    """The items of an arena to evict for `nbytes` of contiguous space (`eviction_window`), or None
    when pins leave no room: `holes` are (offset, bytes), `occupied` (offset, bytes, cost, item)."""
    pieces = _arena_pieces(holes, occupied)
    window = eviction_window([(size, cost) for size, cost, _ in pieces], nbytes)
    return None if window is None else [pieces[i][2] for i in window if pieces[i][2] is not None]


def _arena_pieces(holes: Sequence[tuple[int, int]], occupied: Sequence[tuple]) -> list[tuple[int, int | None, Any]]:
    """An arena in address order, each piece as (bytes, cost, item): holes cost 0 and carry no item.
    A stretch neither covers (between two slabs of the host arena) is a piece that cannot go."""
    ordered = sorted([(offset, size, 0, None) for offset, size in holes] + list(occupied), key=lambda p: p[0])
    pieces, end = [], 0
    for offset, size, cost, item in ordered:
        if offset > end:
            pieces.append((offset - end, None, None))
        pieces.append((size, cost, item))
        end = offset + size
    return pieces


def eviction_window(pieces: Sequence[tuple[int, int | None]], nbytes: int) -> range | None:
    """Which consecutive pieces of an arena to free for `nbytes` of contiguous space. `pieces`:
    (bytes, cost) in address order, tiling the arena; cost None for one that cannot go, 0 for free
    space, else its recency (1: least recently used). The window whose most recent entry is least
    recent wins (every entry it evicts is older than that one), then the one evicting fewer bytes;
    entries beside it that are older still go with it (else a small stale entry between newer ones
    would outlive them all). None when pins leave no window of `nbytes`."""
    best, best_score = None, None
    left, total, evicting, peaks = 0, 0, 0, deque()  # peaks: the window's costs, decreasing
    for right, (size, cost) in enumerate(pieces):
        if cost is None:
            left, total, evicting = right + 1, 0, 0
            peaks.clear()
            continue
        total, evicting = total + size, evicting + size * (cost > 0)
        while peaks and pieces[peaks[-1]][1] <= cost:
            peaks.pop()
        peaks.append(right)
        while total - pieces[left][0] >= nbytes:  # the shortest window ending here
            total, evicting = total - pieces[left][0], evicting - pieces[left][0] * (pieces[left][1] > 0)
            left += 1
            if peaks[0] < left:
                peaks.popleft()
        score = (pieces[peaks[0]][1], evicting)
        if total >= nbytes and (best_score is None or score < best_score):
            best, best_score = range(left, right + 1), score
    return None if best is None else _with_older_neighbours(pieces, best, best_score[0])


def _with_older_neighbours(pieces: Sequence[tuple[int, int | None]], window: range, newest: int) -> range:
    start, stop = window.start, window.stop
    while start > 0 and pieces[start - 1][1] is not None and pieces[start - 1][1] < newest:
        start -= 1
    while stop < len(pieces) and pieces[stop][1] is not None and pieces[stop][1] < newest:
        stop += 1
    return range(start, stop)


class FreeList:
    """Holes of the arena as sorted (offset, size) pairs; adjacent holes are merged on release."""

    def __init__(self, capacity: int) -> None:
        self._holes: list[tuple[int, int]] = [(0, capacity)] if capacity else []

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._holes)

    @property
    def holes(self) -> list[tuple[int, int]]:
        return list(self._holes)

    def allocate(self, nbytes: int) -> int | None:
        for i, (offset, size) in enumerate(self._holes):
            if size >= nbytes:
                self._holes[i: i + 1] = [(offset + nbytes, size - nbytes)] if size > nbytes else []
                return offset
        return None

    def allocate_making_room(self, nbytes: int, make_room) -> int | None:
        """First-fit, calling `make_room()` (False: it can make no more) until a hole fits."""
        offset = self.allocate(nbytes)
        while offset is None and make_room():
            offset = self.allocate(nbytes)
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        i = next((i for i, (o, _) in enumerate(self._holes) if o > offset), len(self._holes))
        self._holes.insert(i, (offset, nbytes))
        if i + 1 < len(self._holes) and offset + nbytes == self._holes[i + 1][0]:
            self._holes[i: i + 2] = [(offset, nbytes + self._holes[i + 1][1])]
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == offset:
            self._holes[i - 1: i + 1] = [(self._holes[i - 1][0], self._holes[i - 1][1] + self._holes[i][1])]


def _view(arena: torch.Tensor, byte_offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    size = math.prod(shape) * dtype.itemsize
    return arena[byte_offset: byte_offset + size].view(dtype).view(shape)


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
