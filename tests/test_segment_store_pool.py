"""The public pool: keys, layout, LRU, pins, budget, flush by salt, accounting, dtype fidelity."""
from __future__ import annotations

import array
import random

import pytest
import torch
import xxhash

from hypic.cache.model_caches import LinearShape
from hypic.cache.prefix_cache import token_bytes
from hypic.cache.segment_store import (SegmentKey, SegmentLayout, SegmentStore, SegmentTuple, TupleStaging,
                                       eviction_window)
from hypic.engine.pic.pieces import Cached
from hypic.kernels.compose import CachedPieces, compose_and_recur, compose_and_recur_ref
from hypic.kernels.linear_families import get_family
from hypic.kernels.scatter_kv import apply_rope, rope_inv_freq, scatter_kv_ref
from tests.test_pic_algebra_families import random_tokens, rel_err

HV, KD, VD, CONV, KV_HEADS, HEAD_DIM = 2, 4, 4, 6, 1, 8


def layout(state_dtype: torch.dtype = torch.float32, family: str = "gdn",
           model_dtype: torch.dtype = torch.float32) -> SegmentLayout:
    shape = LinearShape(get_family(family), HV, KD, VD, CONV, 4)
    return SegmentLayout((shape, shape), num_full=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         state_dtype=state_dtype, model_dtype=model_dtype)


def random_tuple(lay: SegmentLayout, interior_len: int, seed: int = 0) -> SegmentTuple:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n, *shape: [torch.randn(*shape, generator=gen) for _ in range(n)]  # noqa: E731
    kv = (interior_len, KV_HEADS, HEAD_DIM)
    return SegmentTuple((4, 4 + interior_len), rand(2, *lay.t_shape(0)), rand(2, *lay.s0_shape(0)),
                        rand(2, *lay.conv_shape(0)), rand(1, *kv), rand(1, *kv))


def key(name: str, salt: str | None = None) -> SegmentKey:
    return SegmentKey.of("model-abc", 8, salt, token_bytes([ord(c) for c in name]))


def store_for(entries: int, interior_len: int = 5, **kwargs) -> SegmentStore:
    lay = layout(**kwargs)
    return SegmentStore(lay, entries * lay.entry_bytes(interior_len), "cpu")


@pytest.mark.parametrize(("family", "state_dtype"), [("gdn", torch.bfloat16), ("scalar", torch.float32)])
def test_a_staged_tuple_is_stored_as_put_stores_it(family: str, state_dtype: torch.dtype) -> None:
    """Two segments staged part by part for both at once (as a step's layers write them), the second's
    K/V rows in two chunks, read back exactly as `put` of the same tuples stores them; a tuple whose
    rows do not fill its interior is refused with the numbers."""
    lay = layout(state_dtype, family, torch.bfloat16)
    tuples = [random_tuple(lay, 5, seed=1), random_tuple(lay, 5, seed=2)]
    staging = TupleStaging(lay, 2, 10, "cpu")
    for i in range(lay.num_linear):
        for block, name in enumerate(("T", "S0", "conv_tail")):
            staging.part(block, i).copy_(torch.stack([getattr(t, name)[i] for t in tuples]))
    staging.kv.copy_(torch.cat([torch.stack([t.K[0], t.V[0]], 1)[:, None] for t in tuples]))
    staged, direct = store_for(2, family=family, state_dtype=state_dtype, model_dtype=torch.bfloat16), \
        store_for(2, family=family, state_dtype=state_dtype, model_dtype=torch.bfloat16)
    assert staged.put_staged(key("a"), (4, 9), staging.fixed[0], [staging.kv[:5]])
    assert staged.put_staged(key("b"), (4, 9), staging.fixed[1], [staging.kv[5:7], staging.kv[7:]])
    for name, tup in zip("ab", tuples):
        direct.put(key(name), tup)
        got, want = staged.get(key(name)).views(), direct.get(key(name)).views()
        for part in ("T", "S0", "conv_tail", "K", "V"):
            assert all(torch.equal(x, y) for x, y in zip(getattr(got, part), getattr(want, part))), (name, part)
    with pytest.raises(ValueError, match="4 K/V rows"):
        staged.put_staged(key("c"), (4, 9), staging.fixed[0], [staging.kv[:4]])


def test_key_is_content_address() -> None:
    def of(fingerprint: str, seam: int, salt: str | None, ids: list[int]) -> SegmentKey:
        return SegmentKey.of(fingerprint, seam, salt, token_bytes(ids))
    base = of("fp", 8, None, [1, 2, 3])
    assert base == of("fp", 8, None, [1, 2, 3])
    variants = [of("fp", 8, None, [1, 2, 4]), of("fp", 4, None, [1, 2, 3]), of("fp", 8, "", [1, 2, 3]),
                of("fp2", 8, None, [1, 2, 3]), of("fp", 8, "tenant", [1, 2, 3])]
    assert len({base, *variants}) == 6


def test_key_digest_is_unchanged() -> None:
    """Peers exchange keys: the digest is xxh3-128 of the parts and the ids as 8-byte ints."""
    parts = b"fp\x008\x00=tenant\x00" + array.array("q", [5, 70000, 3]).tobytes()
    assert SegmentKey.of("fp", 8, "tenant", token_bytes([5, 70000, 3])).digest == xxhash.xxh3_128(parts).digest()


def test_put_get_round_trip_and_kernel_offsets() -> None:
    store = store_for(2)
    tup = random_tuple(store.layout, 5)
    assert store.put(key("a"), tup)
    entry = store.get(key("a"))
    assert entry is not None and entry.pins == 1 and entry.interior == (4, 9)
    for i in range(2):
        assert torch.equal(entry.T(i), tup.T[i]) and torch.equal(entry.S0(i), tup.S0[i])
        assert torch.equal(entry.conv_tail(i), tup.conv_tail[i])
        t_numel = tup.T[i].numel()
        assert torch.equal(store.t_src(i)[entry.t_offset(i): entry.t_offset(i) + t_numel].view_as(tup.T[i]), tup.T[i])
        s0 = store.s0_src[entry.s0_offset(i): entry.s0_offset(i) + tup.S0[i].numel()]
        assert torch.equal(s0.view_as(tup.S0[i]), tup.S0[i])
    assert torch.equal(entry.K(0), tup.K[0]) and torch.equal(entry.V(0), tup.V[0])
    row = KV_HEADS * HEAD_DIM
    for t in range(5):
        at = entry.kv_offset(0, t)
        assert torch.equal(store.model_src[at: at + row].view(KV_HEADS, HEAD_DIM), tup.K[0][t])
        assert torch.equal(store.model_src[at + row: at + 2 * row].view(KV_HEADS, HEAD_DIM), tup.V[0][t])
    assert store.get(key("b")) is None
    stats = store.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.pinned) == (1, 1, 1, 1)
    assert stats.bytes == store.layout.entry_bytes(5)


def test_lru_evicts_least_recently_used_unpinned() -> None:
    store = store_for(3)
    for name in "abc":
        assert store.put(key(name), random_tuple(store.layout, 5))
    store.unpin(store.get(key("a")))  # a is now the most recent
    assert store.put(key("d"), random_tuple(store.layout, 5))
    assert key("b") not in store and all(key(n) in store for n in "acd")
    assert store.stats().evictions == 1


def test_pins_block_eviction_and_put_fails_when_nothing_can_go() -> None:
    store = store_for(2)
    for name in "ab":
        store.put(key(name), random_tuple(store.layout, 5))
    pinned = [store.get(key(n)) for n in "ab"]
    assert not store.put(key("c"), random_tuple(store.layout, 5))
    assert store.stats().evictions == 0 and all(key(n) in store for n in "ab")
    store.unpin(pinned[1])
    assert store.put(key("c"), random_tuple(store.layout, 5))
    assert key("b") not in store and key("a") in store
    entry = store.get(key("c"))
    store.unpin(entry)
    with pytest.raises(ValueError):
        store.unpin(entry)


def _arena_of(lens: dict[str, int]) -> SegmentStore:
    """A pool exactly filled by entries of these interior lengths, stored in order (first-fit: in
    address order too)."""
    lay = layout()
    store = SegmentStore(lay, sum(lay.entry_bytes(n) for n in lens.values()), "cpu")
    for name, n in lens.items():
        assert store.put(key(name), random_tuple(lay, n))
    return store


@pytest.mark.parametrize(("pinned", "evicted"), [(None, "cd"), ("d", "abc")])
def test_a_large_entry_evicts_one_run_of_old_entries_not_every_older_one(pinned: str | None, evicted: str) -> None:
    """Arena a | b | c | d, least recent first a, c, d, b; e fits in c + d (or a + b, b + c) but in no
    single entry's space. The run c + d has the oldest newest entry, so a stays (evicting the least recent
    until a hole fits would have taken a too); with d pinned, a + b, which evicts fewer bytes than b + c,
    and c beside it, older than b."""
    store = _arena_of({"a": 2, "b": 10, "c": 6, "d": 6})
    assert store.put(key("b"), random_tuple(store.layout, 10))  # b becomes the most recent
    held = store.get(key(pinned)) if pinned else None
    assert store.put(key("e"), random_tuple(store.layout, 14))  # entries grow in steps of 4 rows
    assert {n for n in "abcd" if key(n) not in store} == set(evicted) and key("e") in store
    assert store.stats().evictions == len(evicted)
    if held is not None:
        store.unpin(held)


def test_eviction_window_against_every_window() -> None:
    """The chosen window holds the best of all windows by brute force (most recent entry, then bytes
    evicted) and the older entries beside it, over random arenas of holes, entries and pinned ones."""
    rng = random.Random(0)
    for _ in range(300):
        pieces = [(rng.randrange(1, 9), rng.choice([None, 0, *range(1, 12)])) for _ in range(rng.randrange(1, 12))]
        nbytes = rng.randrange(1, 30)

        def score(window: range) -> tuple[int, int]:
            return (max(pieces[i][1] for i in window), sum(pieces[i][0] for i in window if pieces[i][1] > 0))
        windows = [range(a, b) for a in range(len(pieces)) for b in range(a + 1, len(pieces) + 1)]
        feasible = [w for w in windows if all(pieces[i][1] is not None for i in w)
                    and sum(pieces[i][0] for i in w) >= nbytes]
        got = eviction_window(pieces, nbytes)
        assert (got is None) == (not feasible), (pieces, nbytes)
        if feasible:
            best = min(map(score, feasible))
            assert any(score(w) == best and got.start <= w.start and w.stop <= got.stop for w in feasible)
            assert max(pieces[i][1] for i in got) == best[0], (pieces, nbytes, got)
            beside = [i for i in (got.start - 1, got.stop) if 0 <= i < len(pieces)]
            assert all(pieces[i][1] is None or pieces[i][1] >= best[0] for i in beside), (pieces, nbytes, got)


def test_too_large_entry_is_refused_without_evicting() -> None:
    store = store_for(2)
    store.put(key("a"), random_tuple(store.layout, 5))
    assert not store.put(key("huge"), random_tuple(store.layout, 200))
    assert key("a") in store and store.stats().evictions == 0


def test_put_of_present_key_touches_without_copying() -> None:
    store = store_for(2)
    store.put(key("a"), random_tuple(store.layout, 5, seed=1))
    store.put(key("b"), random_tuple(store.layout, 5))
    assert store.put(key("a"), random_tuple(store.layout, 5, seed=2))  # a becomes most recent
    store.put(key("c"), random_tuple(store.layout, 5))
    assert key("b") not in store
    entry = store.get(key("a"))
    assert torch.equal(entry.T(0), random_tuple(store.layout, 5, seed=1).T[0])


def test_flush_by_salt_frees_pinned_entries_on_last_unpin() -> None:
    store = store_for(4)
    for name, salt in (("a", "x"), ("b", "x"), ("c", "y"), ("d", None)):
        store.put(key(name, salt), random_tuple(store.layout, 5))
    held = store.get(key("a", "x"))
    held_twice = store.get(key("a", "x"))
    assert store.flush("x") == 2
    assert store.get(key("a", "x")) is None and store.get(key("b", "x")) is None
    per_entry = store.layout.entry_bytes(5)
    assert store.stats().bytes == 3 * per_entry and store.stats().entries == 2
    store.unpin(held)
    assert store.stats().bytes == 3 * per_entry  # still one pin
    store.unpin(held_twice)
    assert store.stats().bytes == 2 * per_entry
    assert store.flush() == 2 and store.stats().bytes == 0
    assert store.put(key("big"), random_tuple(store.layout, 5 * 4 + 8))  # holes merged back into one


def test_random_operations_keep_the_books() -> None:
    """Everything allocated is freed: bytes always equal the live entries' bytes; zero at the end."""
    store, rng = store_for(6, interior_len=8), random.Random(0)
    pins: list = []
    for step in range(400):
        op = rng.random()
        name = str(rng.randrange(12))
        if op < 0.45:
            store.put(key(name, rng.choice("xy")), random_tuple(store.layout, rng.randrange(1, 12), seed=step))
        elif op < 0.75:
            entry = store.get(key(name, rng.choice("xy")))
            if entry is not None:
                pins.append(entry)
        elif op < 0.95 and pins:
            store.unpin(pins.pop(rng.randrange(len(pins))))
        else:
            store.flush(rng.choice(["x", "y", None]))
        live = list(store._index.values()) + store._flushed
        assert store.stats().bytes == sum(e.nbytes for e in live) <= store.capacity_bytes
        spans = sorted((e.offset, e.offset + e.nbytes) for e in live)
        pieces = sorted([*spans, *((o, o + n) for o, n in store._free.holes)])
        assert [a for a, _ in pieces[1:]] == [b for _, b in pieces[:-1]] and pieces[-1][1] == store.capacity_bytes
        # entries and holes tile the arena: no overlap, no lost byte (eviction windows rely on it)
    for entry in pins:
        store.unpin(entry)
    store.flush()
    assert store.stats().bytes == 0 and store.stats().pinned == 0
    assert store._free._holes == [(0, store.capacity_bytes)]  # every hole merged back


def test_log_gate_T_is_kept_in_float32() -> None:
    assert layout(torch.bfloat16, family="scalar").t_dtype(0) == torch.float32
    assert layout(torch.bfloat16, family="diagonal").t_dtype(0) == torch.float32
    assert layout(torch.bfloat16, family="kda").t_dtype(0) == torch.bfloat16
    with pytest.raises(ValueError):
        layout(torch.float16)


@pytest.mark.parametrize(("state_dtype", "bound"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_composed_from_store_matches_sequential(state_dtype: torch.dtype, bound: float) -> None:
    """Tuples of two GDN segments, stored then composed in place through entry offsets."""
    family, gen = get_family("gdn"), torch.Generator().manual_seed(0)
    tokens = random_tokens(family, 24, gen, heads=(1, HV), dims=(KD, VD))
    store = store_for(2, interior_len=3, state_dtype=state_dtype)
    rows = []
    for n, (start, end) in enumerate(((0, 12), (12, 24))):
        args = [None if tokens[x] is None else tokens[x][start:end].float() for x in ("k", "v", "g", "beta")]
        T, S0 = family.extract_tuple(*args, torch.tensor([0, end - start]), (end - start,))
        tup = random_tuple(store.layout, 3)
        tup = SegmentTuple(tup.interior, [T[0], T[0]], [S0[0], S0[0]], tup.conv_tail, tup.K, tup.V)
        store.put(key(str(n)), tup)
        entry = store.get(key(str(n)))
        rows.append((0, entry.t_offset(1), entry.s0_offset(1)))  # layer 1 of each entry
    zero = torch.zeros(HV, KD, VD, dtype=torch.float64)
    truth = family.recur(zero, *(tokens[x] for x in ("q", "k", "v", "g", "beta")), scale=1.0)[1]
    pool = torch.zeros(1, HV, KD, VD)
    empty = torch.zeros(0, 1, KD)
    compose_and_recur_ref(empty, empty, torch.zeros(0, HV, VD), torch.zeros(0, HV), torch.zeros(0, HV), pool,
                          torch.tensor([0]), torch.tensor([False]), torch.tensor([0, 0], dtype=torch.int32),
                          CachedPieces.build([rows]), store.t_src(1), store.s0_src, family=family, scale=1.0)
    assert rel_err(pool[0].double(), truth) <= bound


def test_scatter_reads_entry_kv_in_place() -> None:
    store = store_for(1, model_dtype=torch.float32)
    tup = random_tuple(store.layout, 5)
    store.put(key("a"), tup)
    entry = store.get(key("a"))
    src_off = torch.tensor([entry.kv_offset(0, t) for t in range(5)])
    positions = torch.arange(100, 105)
    k_cache = torch.zeros(2, 4, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    dst = torch.tensor([7, 0, 3, 4, 5])
    inv_freq = rope_inv_freq(4, 10000.0)
    scatter_kv_ref(store.model_src, src_off, positions, k_cache, v_cache, dst, inv_freq)
    expected = apply_rope(tup.K[0], positions[:, None], inv_freq)
    assert torch.allclose(k_cache.view(-1, KV_HEADS, HEAD_DIM)[dst], expected, atol=1e-6)
    assert torch.equal(v_cache.view(-1, KV_HEADS, HEAD_DIM)[dst], tup.V[0])


def test_interior_kv_offsets_equal_a_per_token_build() -> None:
    """The admission scatter's per-token positions and store offsets, expanded from one row per
    piece, against each piece's tokens listed one by one."""
    store = store_for(3, interior_len=7)
    entries = []
    for name, length in (("a", 7), ("b", 3), ("c", 5)):
        store.put(key(name), random_tuple(store.layout, length))
        entries.append(store.get(key(name)))
    pieces = [Cached(10, 17, entries[0], True), Cached(30, 33, entries[1], True), Cached(40, 45, entries[2], False)]
    positions, src = store.interior_kv_offsets([(p.start, p.entry) for p in pieces], torch.device("cpu"))
    assert positions.tolist() == [pos for p in pieces for pos in range(p.start, p.end)]
    assert src.tolist() == [p.entry.kv_offset(0, t) for p in pieces for t in range(p.end - p.start)]


@pytest.mark.gpu
def test_store_on_gpu_feeds_the_triton_kernels() -> None:
    """Arena views (bf16 T/S0, bf16 KV) read in place by compose_and_recur and scatter_kv on cuda."""
    family, gen = get_family("gdn"), torch.Generator().manual_seed(1)
    shape = LinearShape(family, 32, 128, 128, 64, 4)
    lay = SegmentLayout((shape, shape), num_full=1, kv_heads=2, head_dim=256, state_dtype=torch.bfloat16,
                        model_dtype=torch.bfloat16)
    store = SegmentStore(lay, 3 * lay.entry_bytes(40), "cuda")
    tokens = random_tokens(family, 90, gen, heads=(16, 32), dims=(128, 128))
    cuda = {n: None if x is None else x.to("cuda", torch.float32) for n, x in tokens.items()}
    rows = []
    for n, (start, end, at) in enumerate(((10, 50, 10), (55, 85, 15))):  # at: flat index of the next seam token
        part = [cuda[x][start:end] for x in ("k", "v", "g", "beta")]
        T, S0 = family.extract_tuple(*part, torch.tensor([0, end - start], device="cuda"), (end - start,))
        kv = [torch.randn(end - start, 2, 256, generator=gen).to("cuda", torch.bfloat16)]
        conv = [torch.zeros(64, 3, device="cuda")] * 2
        assert store.put(key(str(n)), SegmentTuple((start, end), [T[0]] * 2, [S0[0]] * 2, conv, kv, kv))
        entry = store.get(key(str(n)))
        rows.append((at, entry.t_offset(1), entry.s0_offset(1)))
    keep = torch.cat([torch.arange(0, 10), torch.arange(50, 55), torch.arange(85, 90)]).cuda()
    seam = {n: None if x is None else x[keep].to(torch.bfloat16 if n in "qkv" else torch.float32)
            for n, x in cuda.items()}
    args = (seam["q"], seam["k"], seam["v"], seam["g"], seam["beta"])
    outs = []
    # the reference on the CPU: on cuda its GDN spans would run FLA's chunk kernel (bf16 matmuls, ~1e-3)
    for fn, device in ((compose_and_recur, "cuda"), (compose_and_recur_ref, "cpu")):
        pool = torch.zeros(2, 32, 128, 128, device=device)
        o = fn(*(a.to(device) for a in args), pool, torch.tensor([1], device=device),
               torch.tensor([False], device=device), torch.tensor([0, 20], dtype=torch.int32, device=device),
               CachedPieces.build([rows], device), store.t_src(1).to(device), store.s0_src.to(device),
               family=family, scale=0.1)
        outs.append((o.float().cpu(), pool[1].cpu()))
    assert rel_err(outs[0][0], outs[1][0]) <= 1e-2 and rel_err(outs[0][1], outs[1][1]) <= 1e-4


def test_layers_of_different_families_and_shapes_share_an_entry() -> None:
    """Per-linear-layer parts in their own shapes and dtypes (float32 log T beside bf16 dense T): each
    round-trips, and a step's piece table and conv tails moved to layer i land on that layer's part."""
    shapes = (LinearShape(get_family("scalar"), 3, KD, VD, CONV, 4), LinearShape(get_family("gdn"), HV, KD, VD, 5, 4),
              LinearShape(get_family("gdn"), HV, KD, 2, 5, 4))
    lay = SegmentLayout(shapes, num_full=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM, state_dtype=torch.bfloat16,
                        model_dtype=torch.float32)
    assert [lay.t_dtype(i) for i in range(3)] == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert lay.part_offset(0, 1) % 256 == 0 and lay.part_offset(0, 2) == lay.part_offset(0, 1) + HV * KD * KD * 2
    store, gen = SegmentStore(lay, 4 * lay.entry_bytes(5), "cpu"), torch.Generator().manual_seed(3)
    rand = lambda shape: torch.randn(*shape, generator=gen).to(torch.bfloat16).float()  # noqa: E731
    kv = (5, KV_HEADS, HEAD_DIM)
    tuples = [SegmentTuple((4, 9), *[[rand(lay.block_shape(b, i)) for i in range(3)] for b in range(3)],
                           [rand(kv)], [rand(kv)]) for _ in range(2)]
    entries = []
    for n, tup in enumerate(tuples):
        assert store.put(key(str(n)), tup)
        entries.append(store.get(key(str(n))))
    pieces = CachedPieces.build([[(0, e.t_offset(0), e.s0_offset(0)) for e in entries]])
    tails = torch.tensor([e.conv_offset(0) + tap for e in entries for tap in range(3)])
    for i in range(3):
        moved = store.layer_pieces(pieces, i)
        assert moved.t_off.tolist() == [e.t_offset(i) for e in entries]
        assert moved.s0_off.tolist() == [e.s0_offset(i) for e in entries]
        for e, tup, start in zip(entries, tuples, moved.t_off.tolist()):
            assert torch.equal(e.T(i).float(), tup.T[i]) and torch.equal(e.S0(i).float(), tup.S0[i])
            t = store.t_src(i)[start: start + tup.T[i].numel()]
            assert torch.equal(t.view(tup.T[i].shape).float(), tup.T[i])
        expected = torch.cat([tup.conv_tail[i].T for tup in tuples])  # [(piece, tap), channel]
        assert torch.equal(store.conv_tails(tails, i), expected)
