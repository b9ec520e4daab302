"""Exact prefix cache of a hybrid model: a hit needs a recurrent-state checkpoint at exactly the
matched length plus the KV pages under it (DESIGN §3 step 7, §4).

Checkpoints are found by a hash chain over full spans of `hash_span` tokens (nano-vllm hashes each
page; spans of a few pages make a 16k-token checkpoint 256 hash, count and uncount steps, not 1024):
each checkpoint is indexed under the chain hash of its last full span, so any length works; the
token ids are always compared, so a hash collision can cost time but never serve wrong data (a
lookup compares the ids of every checkpoint on its path that ends within one span).
Token ids arrive and are kept as `token_bytes`: a request converts its prompt once (SegmentedPrompt),
so hashing and comparing a prefix are slices and memcmp, not loops over Python ints.
"""
from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from hypic.cache.block_pool import BlockPool
from hypic.cache.model_caches import ModelCaches
from hypic.cache.slot_pool import SlotPool
from hypic.errors import InvalidRequestError

Provenance = str  # how a checkpointed state was computed: "exact", "naive" or "hypic:<seam width>"
EXACT: Provenance = "exact"
NAIVE: Provenance = "naive"


def hypic_provenance(seam_width: int) -> Provenance:
    return f"hypic:{seam_width}"


def accepted_provenances(cache_mode: str, seam_width: int) -> frozenset[Provenance]:
    """The checkpoints a request of this cache mode may start from."""
    accepted = {"none": (), "prefix": (EXACT,), "hypic": (EXACT, hypic_provenance(seam_width)),
                "naive": (EXACT, NAIVE)}
    if cache_mode not in accepted:
        raise InvalidRequestError(f"cache_mode must be one of {tuple(accepted)}, got {cache_mode!r}")
    return frozenset(accepted[cache_mode])


def root_hash(salt: str | None, provenance: Provenance) -> int:
    """Start of a hash chain: other salts and provenances never share one."""
    return xxhash.xxh64(f"{salt!r}\x00{provenance}".encode()).intdigest()


def chain_hash(prev: int, span: bytes) -> int:
    """Hash of one full span of token ids (see `token_bytes`), given the hash of everything before it."""
    return xxhash.xxh64_intdigest(span, seed=prev)


TOKEN_SIZE = 8  # bytes per token id in `token_bytes`
HASH_SPAN = 64  # tokens per link of the hash chain (see the module docstring)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as 8-byte native integers, the form that prefix-cache and segment keys hash and
    compare (one struct.pack: about 2x array('q', ...) on a 16k-token prompt)."""
    return struct.pack(f"{len(tokens)}q", *tokens)


def share_pages(blocks: BlockPool, caches: ModelCaches, block_ids: Sequence[int], num_tokens: int,
                block_size: int) -> list[int]:
    """Pages for another sequence continuing after `num_tokens` tokens: the full ones shared (one
    more ref each) and a partly filled last one copied, since the new sequence writes into it."""
    full = num_tokens // block_size
    own = blocks.allocate(1) if num_tokens % block_size else []  # first: NoFreeBlocks changes nothing
    if own:
        caches.copy_block(block_ids[full], own[0])
    blocks.ref(block_ids[:full])
    return [*block_ids[:full], *own]


@dataclass(frozen=True)
class PrefixHit:
    """A checkpoint a request may start from; pinned until `PrefixCache.release(hit)`."""

    num_tokens: int
    provenance: Provenance
    block_ids: tuple[int, ...]  # the ceil(num_tokens / block_size) pages under the tokens, shared
    state_slot: int  # the checkpoint's own slot: copy it into the request's slot, never write it
    partial_last_block: bool  # block_ids[-1] is only partly filled: copy it before writing (attach does)


@dataclass(frozen=True)
class PrefixCacheStats:
    checkpoints: int
    slots_held: int
    blocks_held: int
    hits: int
    misses: int
    hit_tokens: int
    evictions: int


@dataclass(eq=False)
class _Checkpoint:
    tokens: bytes  # token_bytes of its token ids
    salt: str | None
    provenance: Provenance
    slot: int
    block_ids: tuple[int, ...]
    chain: tuple[int, ...]  # root hash, then the chain hash after each full span
    pins: int = 0
    dropped: bool = False  # no longer served; its slot and blocks go back at the last release

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_SIZE


def _serves(cp: _Checkpoint, tokens: bytes, salt: str | None, provenance: Provenance) -> bool:
    """The checkpoint may start a request for `tokens` (checked on the token ids, not on hashes)."""
    return (len(cp.tokens) < len(tokens) and cp.salt == salt and cp.provenance == provenance
            and tokens.startswith(cp.tokens))


class PrefixCache:
    """LRU set of checkpoints. Each one owns a state slot and one ref on each block it covers."""

    def __init__(self, blocks: BlockPool, slots: SlotPool, caches: ModelCaches, block_size: int,
                 max_slots: int, hash_span: int = HASH_SPAN) -> None:
        self._blocks, self._slots, self._caches = blocks, slots, caches
        self.block_size, self.max_slots, self.hash_span = block_size, max_slots, hash_span
        self._held: dict[int, _Checkpoint] = {}  # slot -> every checkpoint owning a slot
        self._lru: OrderedDict[int, _Checkpoint] = OrderedDict()  # slot -> servable ones, oldest first
        self._by_key: dict[int, list[_Checkpoint]] = {}  # chain hash of the last full span -> checkpoints
        self._on_path: Counter[int] = Counter()  # chain hashes leading to a checkpoint: where lookups stop
        self._last: _Checkpoint | None = None  # the last one inserted (or refreshed): its chain may go on
        self._hits = self._misses = self._hit_tokens = self._evictions = 0

    def insert(self, tokens: bytes, salt: str | None, provenance: Provenance,
               block_ids: Sequence[int], state_slot: int) -> bool:
        """Keep the state of `state_slot` as the checkpoint of `tokens` (token_bytes of the ids);
        False if no slot can be had."""
        num_tokens = len(tokens) // TOKEN_SIZE
        if not num_tokens:
            return False
        num_blocks = -(-num_tokens // self.block_size)
        if len(block_ids) < num_blocks:
            raise ValueError(f"{num_tokens} tokens need {num_blocks} blocks, got {len(block_ids)}")
        chain = self._chain(tokens, salt, provenance)
        if (old := self._find(chain[-1], tokens, salt, provenance)) is not None:
            self._lru.move_to_end(old.slot)
            self._last = old
            return True
        if (slot := self._take_slot()) is None:
            return False
        self._caches.copy_slot(state_slot, slot)
        cp = _Checkpoint(tokens, salt, provenance, slot, tuple(block_ids[:num_blocks]), chain)
        self._blocks.ref(cp.block_ids)
        self._held[slot] = self._lru[slot] = self._last = cp
        self._by_key.setdefault(chain[-1], []).append(cp)
        self._on_path.update(chain)
        return True

    def lookup(self, tokens: bytes, salt: str | None, accept: frozenset[Provenance], *,
               not_inside: Sequence[tuple[int, int]] = ()) -> PrefixHit | None:
        """Longest checkpoint of this salt, of an accepted provenance, whose tokens are a proper prefix
        of `tokens` (token_bytes of the ids; one token at least is left to compute) and whose length
        is not strictly inside one of the `not_inside` spans. Ties prefer an exact one."""
        if not accept:
            return None  # the request reads no cache: not a lookup
        matches = [cp for p in accept for cp in self._matches(tokens, salt, p)
                   if not any(start < cp.num_tokens < end for start, end in not_inside)]
        if not matches:
            self._misses += 1
            return None
        best = max(matches, key=lambda cp: (cp.num_tokens, cp.provenance == EXACT))
        best.pins += 1
        self._lru.move_to_end(best.slot)
        n = best.num_tokens
        self._hits, self._hit_tokens = self._hits + 1, self._hit_tokens + n
        return PrefixHit(n, best.provenance, best.block_ids, best.slot, n % self.block_size != 0)

    def attach(self, hit: PrefixHit) -> list[int]:
        """The request's blocks for the hit's tokens (see `share_pages`)."""
        return share_pages(self._blocks, self._caches, hit.block_ids, hit.num_tokens, self.block_size)

    def release(self, hit: PrefixHit) -> None:
        """Unpin the hit's checkpoint, once its state has been copied."""
        cp = self._held.get(hit.state_slot)
        if cp is None or cp.pins == 0:
            raise RuntimeError(f"internal error: release of an unpinned prefix hit (slot {hit.state_slot})")
        cp.pins -= 1
        if cp.dropped and cp.pins == 0:
            self._free(cp)

    def evict_one(self) -> bool:
        """Drop the least recently used unpinned checkpoint; False if there is none."""
        cp = next((cp for cp in self._lru.values() if cp.pins == 0), None)
        if cp is None:
            return False
        self._drop(cp)
        self._evictions += 1
        return True

    def evict_until(self, free_blocks: int, free_slots: int) -> bool:
        """Evict until the pools have this many free blocks and slots; False if they cannot."""
        while self._blocks.num_free < free_blocks or self._slots.num_free < free_slots:
            if not self.evict_one():
                return False
        return True

    def clear(self, salt: str | None = None) -> None:
        """Drop every checkpoint (salt None) or those of one salt; pinned ones go at their release."""
        for cp in [cp for cp in self._lru.values() if salt is None or cp.salt == salt]:
            self._drop(cp)

    def stats(self) -> PrefixCacheStats:
        blocks = set().union(*(cp.block_ids for cp in self._held.values()))
        return PrefixCacheStats(len(self._lru), len(self._held), len(blocks), self._hits, self._misses,
                                self._hit_tokens, self._evictions)

    def _chain(self, tokens: bytes, salt: str | None, provenance: Provenance) -> tuple[int, ...]:
        """The root hash, then the chain hash after each full span of `tokens`."""
        width = TOKEN_SIZE * self.hash_span
        hashes = self._continued_chain(tokens, salt, provenance) or [root_hash(salt, provenance)]
        for start in range(width * (len(hashes) - 1), len(tokens) - width + 1, width):
            hashes.append(chain_hash(hashes[-1], tokens[start:start + width]))
        return tuple(hashes)

    def _continued_chain(self, tokens: bytes, salt: str | None, provenance: Provenance) -> list[int]:
        """The last insert's chain when its full spans start `tokens` (else none): a request
        checkpoints its prompt but the last token, then the whole prompt, and the second insert
        then hashes one span at most."""
        last = self._last
        if last is None or last.salt != salt or last.provenance != provenance:
            return []
        hashed = TOKEN_SIZE * self.hash_span * (len(last.chain) - 1)
        return list(last.chain) if tokens[:hashed] == last.tokens[:hashed] else []

    def _find(self, key: int, tokens: bytes, salt: str | None, provenance: Provenance) -> _Checkpoint | None:
        return next((cp for cp in self._by_key.get(key, ())
                     if cp.tokens == tokens and cp.salt == salt and cp.provenance == provenance), None)

    def _matches(self, tokens: bytes, salt: str | None, provenance: Provenance) -> list[_Checkpoint]:
        """Checkpoints of this salt and provenance whose tokens are a proper prefix of `tokens`."""
        width, start, key, found = TOKEN_SIZE * self.hash_span, 0, root_hash(salt, provenance), []
        while key in self._on_path:  # key: chain hash of the first `start` bytes
            for cp in self._by_key.get(key, ()):
                if _serves(cp, tokens, salt, provenance):
                    found.append(cp)
            start += width
            if start >= len(tokens):
                break
            key = chain_hash(key, tokens[start - width: start])
        return found

    def _take_slot(self) -> int | None:
        """A fresh slot for a checkpoint, evicting LRU ones to stay within max_slots."""
        while len(self._held) >= self.max_slots or self._slots.num_free == 0:
            if not self.evict_one():
                return None
        return self._slots.allocate()

    def _drop(self, cp: _Checkpoint) -> None:
        """Stop serving a checkpoint; free it now, or at its last release if pinned."""
        del self._lru[cp.slot]
        self._by_key[cp.chain[-1]].remove(cp)
        if not self._by_key[cp.chain[-1]]:
            del self._by_key[cp.chain[-1]]
        on_path = self._on_path
        for h in cp.chain:
            count = on_path[h]
            if count > 1:
                on_path[h] = count - 1
            else:  # pop, not del: Counter's __delitem__ is Python code (1.2 ms for a 16k-token chain)
                on_path.pop(h)
        cp.dropped = True
        if cp.pins == 0:
            self._free(cp)

    def _free(self, cp: _Checkpoint) -> None:
        del self._held[cp.slot]
        self._slots.release(cp.slot)
        self._blocks.release(cp.block_ids)
