"""PrefixCache on a tiny real ModelCaches (CPU): hits, LRU, pins, isolation, accounting."""
from __future__ import annotations

import array
import contextlib
from unittest import mock

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic.cache import prefix_cache
from hypic.cache.block_pool import BlockPool, NoFreeBlocks
from hypic.cache.model_caches import CacheShape, LinearShape, ModelCaches
from hypic.cache.prefix_cache import EXACT, NAIVE, PrefixCache, PrefixHit, accepted_provenances, token_bytes
from hypic.cache.slot_pool import SlotPool
from hypic.errors import InvalidRequestError
from hypic.kernels.linear_families import get_family

BS = 4
SHAPE = CacheShape(full_layers=(1,), linear_layers=(0, 2), num_kv_heads=1, head_dim=2,
                   linear=(LinearShape(get_family("gdn"), value_heads=1, key_dim=2, value_dim=2, conv_dim=3,
                                       conv_kernel=3),) * 2)
PREFIX = accepted_provenances("prefix", 8)
HYPIC8 = "hypic:8"


class Engine:
    """The pools, the caches and the prefix cache, plus a fake request that 'computes' tokens:
    token t at position i leaves K = t, V = -t in its page, and the state slot holds a tag."""

    def __init__(self, num_blocks: int = 32, num_slots: int = 8, max_slots: int = 4, hash_span: int = BS) -> None:
        """hash_span: one page, so that these short prompts walk hash chains of several links."""
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.blocks, self.slots = BlockPool(num_blocks), SlotPool(num_slots)
        self.caches = ModelCaches(SHAPE, num_blocks, BS, num_slots, torch.float32, torch.device("cpu"))
        self.cache = PrefixCache(self.blocks, self.slots, self.caches, BS, max_slots, hash_span)

    def compute(self, tokens: list[int], tag: float) -> tuple[list[int], int]:
        ids, slot = self.blocks.allocate(-(-len(tokens) // BS)), self.slots.allocate()
        k, v = self.caches.kv(1)
        for i, t in enumerate(tokens):
            k[ids[i // BS], i % BS], v[ids[i // BS], i % BS] = t, -t
        for layer in SHAPE.linear_layers:
            ssm, conv = self.caches.state(layer)
            ssm[slot], conv[slot] = tag, tag + layer
        return ids, slot

    def keep(self, tokens: list[int], tag: float = 1.0, salt: str | None = None, provenance: str = EXACT) -> bool:
        """A request computes `tokens`, checkpoints them, and finishes."""
        ids, slot = self.compute(tokens, tag)
        kept = self.cache.insert(token_bytes(tokens), salt, provenance, ids, slot)
        self.blocks.release(ids)
        self.slots.release(slot)
        return kept

    def tag(self, slot: int) -> float:
        return self.caches.state(0)[0][slot].flatten()[0].item()

    def hit_length(self, tokens: list[int], salt: str | None = None, accept: frozenset[str] = PREFIX) -> int:
        hit = self.cache.lookup(token_bytes(tokens), salt, accept)
        if hit is None:
            return 0
        self.cache.release(hit)
        return hit.num_tokens

    def assert_all_free(self) -> None:
        assert self.blocks.num_free == self.num_blocks and self.slots.num_free == self.num_slots
        assert all(self.blocks.refcount(i) == 0 for i in range(self.num_blocks))


def test_partial_hit_copies_its_last_block_on_attach() -> None:
    eng, tokens = Engine(), list(range(1, 11))  # 10 tokens: blocks of 4, 4 and 2
    assert eng.keep(tokens, tag=7.0)
    hit = eng.cache.lookup(token_bytes(tokens + [11, 12]), None, PREFIX)
    assert hit is not None and hit.num_tokens == 10 and hit.partial_last_block and len(hit.block_ids) == 3
    ids = eng.cache.attach(hit)
    assert ids[:2] == list(hit.block_ids[:2]) and ids[2] not in hit.block_ids
    assert [eng.blocks.refcount(i) for i in ids] == [2, 2, 1]
    k, v = eng.caches.kv(1)
    assert torch.equal(k[ids[2], :2, 0, 0], torch.tensor([9.0, 10.0]))
    assert torch.equal(v[ids[2], :2, 0, 0], torch.tensor([-9.0, -10.0]))
    k[ids[2], 2] = 99.0  # the request writes its next token: the checkpoint's page must not change
    assert k[hit.block_ids[2], 2, 0, 0].item() == 0.0
    slot = eng.slots.allocate()
    eng.caches.copy_slot(hit.state_slot, slot)
    eng.cache.release(hit)
    assert eng.tag(slot) == 7.0 and eng.caches.state(2)[1][slot].flatten()[0].item() == 9.0
    eng.blocks.release(ids)
    eng.slots.release(slot)
    eng.cache.clear()
    eng.assert_all_free()


def test_aligned_hit_shares_every_block() -> None:
    eng = Engine()
    eng.keep(list(range(8)))
    hit = eng.cache.lookup(token_bytes(range(9)), None, PREFIX)
    assert hit is not None and not hit.partial_last_block
    ids = eng.cache.attach(hit)
    assert ids == list(hit.block_ids) and [eng.blocks.refcount(i) for i in ids] == [2, 2]
    eng.cache.release(hit)
    eng.blocks.release(ids)
    eng.cache.clear()
    eng.assert_all_free()


def test_attach_without_a_free_block_takes_nothing() -> None:
    eng = Engine(num_blocks=2)
    eng.keep([1, 2, 3, 4, 5])
    taken = eng.blocks.allocate(eng.blocks.num_free)
    hit = eng.cache.lookup(token_bytes([1, 2, 3, 4, 5, 6]), None, PREFIX)
    with pytest.raises(NoFreeBlocks):
        eng.cache.attach(hit)
    assert [eng.blocks.refcount(i) for i in hit.block_ids] == [1, 1]
    eng.cache.release(hit)
    eng.blocks.release(taken)
    eng.cache.clear()
    eng.assert_all_free()


def test_lookup_picks_the_longest_proper_prefix() -> None:
    eng, tokens = Engine(max_slots=8), list(range(100, 120))
    for n in (3, 5, 8, 11):
        eng.keep(tokens[:n])
    assert eng.hit_length(tokens) == 11
    assert eng.hit_length(tokens[:11]) == 8  # the 11-token checkpoint would leave nothing to compute
    assert eng.hit_length(tokens[:9]) == 8
    assert eng.hit_length(tokens[:6]) == 5
    assert eng.hit_length(tokens[:4]) == 3
    assert eng.hit_length(tokens[:3]) == 0
    assert eng.hit_length(tokens[:6] + [0] + tokens[7:]) == 5  # diverges at position 6
    assert eng.hit_length([0] + tokens[1:]) == 0


def test_lookup_skips_checkpoints_strictly_inside_a_span() -> None:
    """A request with cached interiors may resume before, at or past one, never inside one."""
    eng, tokens = Engine(max_slots=8), list(range(100, 120))
    for n in (3, 6, 9, 14):
        eng.keep(tokens[:n])

    def hit(spans) -> int:
        found = eng.cache.lookup(token_bytes(tokens), None, PREFIX, not_inside=spans)
        eng.cache.release(found)
        return found.num_tokens
    assert hit([(4, 9)]) == 14  # past the span
    assert hit([(9, 15)]) == 9  # 14 is inside, 9 is at its start
    assert hit([(5, 9), (10, 16)]) == 9  # at the end of one span, before the other
    assert eng.cache.lookup(token_bytes(tokens), None, PREFIX, not_inside=[(2, 16)]) is None  # every one is inside


def test_lru_eviction_order() -> None:
    eng = Engine(max_slots=2)
    a, b, c = [1] * 5, [2] * 5, [3] * 5
    eng.keep(a), eng.keep(b)
    assert eng.hit_length(a + [0]) == 5  # a is now the most recently used
    eng.keep(c)
    assert eng.hit_length(b + [0]) == 0 and eng.hit_length(a + [0]) == 5
    assert eng.keep(c)  # a duplicate only refreshes: c is newest, a oldest
    eng.keep(b)
    assert eng.hit_length(a + [0]) == 0 and eng.hit_length(c + [0]) == 5
    assert eng.cache.stats().evictions == 2 and eng.cache.stats().checkpoints == 2


def test_slot_pool_exhaustion_evicts_checkpoints() -> None:
    eng = Engine(num_slots=3, max_slots=2)
    eng.keep([1] * 4)
    held = eng.slots.allocate()  # a running request
    assert eng.keep([2] * 4)  # its request takes the last slot: the first checkpoint goes
    assert eng.hit_length([1] * 5) == 0 and eng.hit_length([2] * 5) == 4
    eng.slots.release(held)


def test_pinned_checkpoint_is_not_evicted() -> None:
    eng = Engine(max_slots=1)
    eng.keep([1] * 6, tag=3.0)
    hit = eng.cache.lookup(token_bytes([1] * 7), None, PREFIX)
    assert not eng.keep([2] * 6)
    assert not eng.cache.evict_one()
    assert not eng.cache.evict_until(free_blocks=0, free_slots=eng.num_slots)
    assert eng.tag(hit.state_slot) == 3.0
    eng.cache.release(hit)
    assert eng.keep([2] * 6)
    with pytest.raises(RuntimeError):
        eng.cache.release(hit)


def test_clear_while_pinned_frees_at_release() -> None:
    eng = Engine()
    eng.keep([1] * 6)
    hit = eng.cache.lookup(token_bytes([1] * 7), None, PREFIX)
    eng.cache.clear()
    assert eng.cache.lookup(token_bytes([1] * 7), None, PREFIX) is None
    assert eng.cache.stats().slots_held == 1 and eng.cache.stats().checkpoints == 0
    eng.cache.release(hit)
    eng.assert_all_free()


def test_evict_until_frees_memory() -> None:
    eng = Engine(num_blocks=8, max_slots=4)
    for t in range(4):
        eng.keep([t] * 8)  # two blocks each: every block is held by a checkpoint
    assert eng.blocks.num_free == 0
    assert eng.cache.evict_until(free_blocks=3, free_slots=0)
    assert eng.blocks.num_free == 4 and eng.cache.stats().checkpoints == 2
    assert eng.hit_length([0] * 9) == 0 and eng.hit_length([3] * 9) == 8
    assert not eng.cache.evict_until(free_blocks=9, free_slots=0)
    eng.assert_all_free()


def test_salt_isolation_and_clear_by_salt() -> None:
    eng = Engine()
    eng.keep([5] * 6, salt="a")
    eng.keep([5] * 5, salt="b")
    assert eng.hit_length([5] * 9, salt="a") == 6
    assert eng.hit_length([5] * 9, salt="b") == 5
    assert eng.hit_length([5] * 9, salt=None) == 0
    assert eng.hit_length([5] * 9, salt="c") == 0
    eng.cache.clear("a")
    assert eng.hit_length([5] * 9, salt="a") == 0 and eng.hit_length([5] * 9, salt="b") == 5
    eng.cache.clear()
    eng.assert_all_free()


def test_accepted_provenances() -> None:
    assert accepted_provenances("none", 8) == frozenset()
    assert accepted_provenances("prefix", 8) == {EXACT}
    assert accepted_provenances("hypic", 4) == {EXACT, "hypic:4"}
    assert accepted_provenances("naive", 8) == {EXACT, NAIVE}
    with pytest.raises(InvalidRequestError):
        accepted_provenances("bogus", 8)


def test_provenance_filtering() -> None:
    eng, tokens = Engine(), list(range(12))
    eng.keep(tokens[:4], provenance=EXACT)
    eng.keep(tokens[:9], provenance=HYPIC8)
    assert eng.hit_length(tokens) == 4
    assert eng.hit_length(tokens, accept=accepted_provenances("hypic", 8)) == 9
    assert eng.hit_length(tokens, accept=accepted_provenances("hypic", 4)) == 4
    assert eng.hit_length(tokens, accept=accepted_provenances("naive", 8)) == 4
    assert eng.cache.lookup(token_bytes(tokens), None, accepted_provenances("none", 8)) is None
    eng.keep(tokens[:9], tag=2.0, provenance=EXACT)
    hit = eng.cache.lookup(token_bytes(tokens), None, accepted_provenances("hypic", 8))
    assert hit.provenance == EXACT and eng.tag(hit.state_slot) == 2.0  # an equal-length tie prefers exact
    eng.cache.release(hit)


def test_stats_count_hits_misses_and_holdings() -> None:
    eng = Engine()
    ids, slot = eng.compute([1] * 8, 1.0)
    eng.cache.insert(token_bytes([1] * 6), None, EXACT, ids, slot)  # both checkpoints share the request's 2 blocks
    eng.cache.insert(token_bytes([1] * 8), None, EXACT, ids, slot)
    eng.blocks.release(ids)
    eng.slots.release(slot)
    eng.hit_length([1] * 9)
    eng.hit_length([2] * 9)
    assert eng.cache.stats() == prefix_cache.PrefixCacheStats(
        checkpoints=2, slots_held=2, blocks_held=2, hits=1, misses=1, hit_tokens=8, evictions=0)


def _reference_chain(tokens: list[int], salt: str | None, provenance: str, span: int) -> tuple[int, ...]:
    """The chain as first written: ids packed by array('q'), each full span hashed from scratch."""
    data, width = array.array("q", tokens).tobytes(), 8 * span
    hashes = [xxhash.xxh64(f"{salt!r}\x00{provenance}".encode()).intdigest()]
    for start in range(0, len(data) - width + 1, width):
        hashes.append(xxhash.xxh64_intdigest(data[start:start + width], seed=hashes[-1]))
    return tuple(hashes)


@pytest.mark.parametrize("span", [BS, 6])
def test_a_chain_continued_from_the_last_insert_equals_one_hashed_from_scratch(span: int) -> None:
    """A request checkpoints its prompt but one token, then all of it: the second insert goes on
    from the first one's chain, which is only right when those spans start its tokens."""
    eng, tokens = Engine(num_blocks=64, max_slots=8, hash_span=span), list(range(100, 130))
    inserts = [(tokens[:11], None, EXACT), (tokens[:12], None, EXACT), (tokens[:21], None, EXACT),
               (tokens[:9], None, EXACT), ([0] + tokens[1:21], None, EXACT), (tokens[:25], "a", EXACT),
               (tokens[:26], "a", HYPIC8), (tokens[:26], "a", HYPIC8)]
    for ids, salt, provenance in inserts:
        assert eng.keep(ids, salt=salt, provenance=provenance)
    chains = {(cp.tokens, cp.salt, cp.provenance): cp.chain for cp in eng.cache._held.values()}
    assert len(chains) == len(inserts) - 1  # the last insert only refreshed its twin
    for ids, salt, provenance in inserts:
        assert chains[(token_bytes(ids), salt, provenance)] == _reference_chain(ids, salt, provenance, span)
    assert eng.hit_length(tokens[:22]) == 21 and eng.hit_length(tokens[:12]) == 11


def _reference_longest(stored: dict, tokens: list[int], salt: str | None, accept: frozenset[str]) -> int:
    lengths = [len(t) for (t, s, p) in stored if s == salt and p in accept and len(t) < len(tokens)
               and tuple(tokens[:len(t)]) == t]
    return max(lengths, default=0)


requests = st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=11), st.sampled_from([None, "a"]),
                     st.sampled_from([EXACT, HYPIC8]))


@pytest.mark.parametrize("span", [BS, 3, prefix_cache.HASH_SPAN])
@pytest.mark.parametrize("collide", [False, True], ids=["xxhash", "constant-hash"])
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), requests), max_size=24))
def test_lookups_match_a_brute_force_reference(collide: bool, span: int, ops: list) -> None:
    """Even when every hash collides, a hit is exactly the longest stored proper prefix, and its
    state is the one stored for those tokens, whatever the hash span (one page, less, more)."""
    zero_hashes = {"chain_hash": lambda prev, data: 0, "root_hash": lambda salt, provenance: 0}
    with mock.patch.multiple(prefix_cache, **zero_hashes) if collide else contextlib.nullcontext():
        eng, stored = Engine(num_blocks=80, num_slots=30, max_slots=30, hash_span=span), {}
        for i, (is_insert, (tokens, salt, provenance)) in enumerate(ops):
            if is_insert:
                assert eng.keep(tokens, tag=float(i), salt=salt, provenance=provenance)
                stored.setdefault((tuple(tokens), salt, provenance), float(i))
                continue
            accept = accepted_provenances("hypic", 8) if provenance == HYPIC8 else PREFIX
            hit = eng.cache.lookup(token_bytes(tokens), salt, accept)
            assert (hit.num_tokens if hit else 0) == _reference_longest(stored, tokens, salt, accept)
            if hit:
                assert eng.tag(hit.state_slot) == stored[(tuple(tokens[:hit.num_tokens]), salt, hit.provenance)]
                eng.cache.release(hit)
        eng.cache.clear()
        eng.assert_all_free()


def test_prefix_hit_is_frozen() -> None:
    hit = PrefixHit(4, EXACT, (0,), 0, False)
    with pytest.raises(AttributeError):
        hit.num_tokens = 5  # type: ignore[misc]
