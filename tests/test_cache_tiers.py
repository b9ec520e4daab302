"""The pool's lower tiers on their own: demotion and promotion keep the bytes, LRU per tier, pins,
flush by salt across tiers, salts on disk only as hashes, identity of a disk directory."""
from __future__ import annotations

import shutil
import threading
import weakref

import pytest
import torch

from hypic.cache.disk_tier import READ_RATE, DiskTier, kept_rates
from hypic.cache import tiers
from hypic.cache.segment_store import ALIGN, SegmentStore, SegmentTuple
from hypic.cache.tiers import LowerTiers
from hypic.config import EngineConfig
from hypic.engine.setup import segment_host_bytes
from hypic.models.checkpoint import weights_digest
from tests.test_segment_store_pool import key, layout, random_tuple

LEN = 5


def tiered(pool: int, host: int, disk_dir=None, disk: int = 1 << 30, fingerprint: str = "fp") -> SegmentStore:
    """A pool of `pool` entries over a host tier of `host` (and a disk tier when a directory is given)."""
    lay = layout()
    below = None if disk_dir is None else DiskTier(disk_dir, disk, fingerprint, lay)
    return SegmentStore(lay, pool * lay.entry_bytes(LEN), "cpu", LowerTiers(host * lay.entry_bytes(LEN),
                                                                           torch.device("cpu"), below))


def fill(store: SegmentStore, names: str) -> dict[str, object]:
    tuples = {name: random_tuple(store.layout, LEN, seed=ord(name)) for name in names}
    for name, tup in tuples.items():
        assert store.put(key(name), tup)
        store.lower.drain()  # as steps apart would: a disk write still under way pins its host entry
    return tuples


def get(store: SegmentStore, k):
    """`store.get`, after reading the entry from disk first if only the disk holds it."""
    if store.start_read(k):
        store.lower.drain()
        assert store.finished_reads() == [k]
    return store.get(k)


def assert_holds(store: SegmentStore, name: str, tup, source: str) -> None:
    entry = get(store, key(name))
    assert entry is not None and entry.source == source and entry.interior == tup.interior
    got = entry.views()
    for part in ("T", "S0", "conv_tail", "K", "V"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(got, part), getattr(tup, part)))
    store.unpin(entry)


def test_evicted_entries_are_demoted_byte_for_byte_and_promoted_back() -> None:
    store = tiered(pool=1, host=2)
    tuples = fill(store, "abc")  # a and b go down, c stays
    assert store.stats().evictions == 2 == store.stats().demotions
    assert all(key(n) in store for n in "abc")
    assert_holds(store, "a", tuples["a"], "host")  # promoted: c goes down
    assert_holds(store, "a", tuples["a"], "pool")
    assert_holds(store, "c", tuples["c"], "host")
    host = store.lower.stats()
    assert (host.hits, host.promotions, host.demotions, host.entries) == (2, 2, 3, 2)
    assert host.evictions == 1  # b, the least recently used below, made room for c


def test_a_pinned_host_entry_is_never_evicted_and_pins_return() -> None:
    store = tiered(pool=1, host=1)
    fill(store, "ab")
    claim = store.lower.claim(key("a"))
    assert claim is not None and store.lower.stats().pinned == 1
    assert store.put(key("c"), random_tuple(store.layout, LEN, seed=9))  # b cannot be demoted: host is pinned
    assert key("b") not in store and key("a") in store
    store.lower.release(claim)
    assert store.lower.stats().pinned == 0


def test_flush_of_one_salt_reaches_every_tier(tmp_path) -> None:
    store = tiered(pool=1, host=1, disk_dir=tmp_path)
    for name, salt in (("a", "t1"), ("b", "t2"), ("c", "t1"), ("d", None)):
        assert store.put(key(name, salt), random_tuple(store.layout, LEN))
        store.lower.drain()
    assert all(key(n, s) in store for n, s in (("a", "t1"), ("b", "t2"), ("c", "t1")))
    assert store.flush("t1") >= 2
    store.lower.drain()
    assert key("a", "t1") not in store and key("c", "t1") not in store
    assert key("b", "t2") in store and get(store, key("b", "t2")) is not None
    on_disk = b"".join(p.read_bytes() for p in tmp_path.rglob("*.seg"))
    assert b"t1" not in on_disk and b"t2" not in on_disk  # salts are stored as hashes only


def test_disk_budget_is_lru_and_a_restart_finds_the_files(tmp_path) -> None:
    lay = layout()
    store = tiered(pool=1, host=1, disk_dir=tmp_path, disk=2 * (lay.entry_bytes(LEN) + 200))
    tuples = fill(store, "abcd")  # a, b, c are written; a drops for c
    store.lower.drain()
    disk = store.lower.disk.stats()
    assert (disk.entries, disk.demotions, disk.evictions) == (2, 3, 1) and disk.bytes <= disk.capacity_bytes
    again = tiered(pool=1, host=1, disk_dir=tmp_path)
    assert key("a") not in again and key("b") in again
    assert_holds(again, "b", tuples["b"], "disk")
    assert_holds(again, "c", tuples["c"], "disk")


@pytest.mark.parametrize("change", ["fingerprint", "layout"])
def test_a_directory_of_another_model_or_layout_is_not_read(tmp_path, change) -> None:
    store = tiered(pool=1, host=1, disk_dir=tmp_path)
    fill(store, "abc")
    store.lower.drain()
    lay = layout(state_dtype=torch.bfloat16) if change == "layout" else layout()
    other = DiskTier(tmp_path, 1 << 30, "other-weights" if change == "fingerprint" else "fp", lay)
    assert other.stats().entries == 0 and key("a") not in other
    assert other.start_read(key("a"), torch.empty(0, dtype=torch.uint8)) is None
    assert DiskTier(tmp_path, 1 << 30, "fp", layout()).stats().entries == 2  # the first model's files remain


def test_a_failed_write_costs_only_the_entry(tmp_path) -> None:
    store = tiered(pool=1, host=1, disk_dir=tmp_path)
    disk = store.lower.disk
    shutil.rmtree(disk.directory)  # every write now fails
    fill(store, "abc")
    store.lower.drain()
    assert disk.stats().errors == 2 and disk.stats().entries == 0
    assert store.lower.stats().pinned == 0 and key("b") in store


def test_the_host_arena_grows_a_slab_at_a_time_and_entries_never_span_two() -> None:
    lay = layout()
    entry = lay.entry_bytes(LEN)
    store = SegmentStore(lay, entry, "cpu", LowerTiers(6 * entry + entry // 2, torch.device("cpu"), None, 2 * entry))
    arena = store.lower.arena
    assert store.lower.capacity_bytes == 6 * entry and arena.allocated_bytes == 2 * entry  # whole slabs only
    tuples = fill(store, "abcd")  # a, b, c go down: the third needs a second slab
    assert arena.allocated_bytes == 4 * entry and store.lower.stats().bytes == 3 * entry
    tuples |= fill(store, "efgh")  # a..g below fill three slabs; g's demotion evicts a
    assert arena.allocated_bytes == 6 * entry and store.lower.stats().evictions == 1 and key("a") not in store
    assert [store.tier(key(name)) for name in "bcdefgh"] == ["host"] * 6 + ["pool"]
    for name in "gfed":  # entries of all three slabs; g's promotion demotes h (b goes), then each is kept below
        assert_holds(store, name, tuples[name], "host")
    assert store.lower.stats().evictions == 2 and store.tier(key("c")) == "host"
    assert store.lower.demote(key("z"), (0, 3 * LEN), torch.zeros(3 * entry, dtype=torch.uint8)) is None
    assert key("z") not in store.lower and store.lower.stats().evictions == 2  # larger than a slab: dropped alone


def test_slabs_pinned_ahead_on_a_thread_are_taken_in_order_as_entries_need_them(monkeypatch) -> None:
    made = []

    def new_slab(nbytes: int, pin: bool) -> torch.Tensor:
        made.append((threading.current_thread().name, pin))
        return torch.full((nbytes,), len(made), dtype=torch.uint8)  # plain memory stands in for pinned
    monkeypatch.setattr(tiers, "_new_slab", new_slab)
    arena = tiers.HostArena(3 * ALIGN + 5, ALIGN, pin=True)
    assert arena.capacity_bytes == 3 * ALIGN and len(arena.slabs) == 1  # whole slabs; the first at once
    assert made == [("MainThread", True)]  # no pinning beside start-up (the engine captures its graphs then)
    for count in (2, 3):
        arena.wait()
        assert arena.grow() and len(arena.slabs) == count
    assert not arena.grow()  # the budget
    assert [int(slab[0]) for slab in arena.slabs] == [1, 2, 3]
    assert made == [("MainThread", True), ("hypic-host-pin", True), ("hypic-host-pin", True)]
    assert arena.view(2 * (ALIGN + ALIGN) + 7, 3).tolist() == [3, 3, 3]  # offsets of slab k start k gaps apart


def test_the_thread_pins_one_slab_ahead_of_the_entries_not_the_whole_budget(monkeypatch) -> None:
    made = []

    def new_slab(nbytes: int, pin: bool) -> torch.Tensor:
        made.append(threading.current_thread().name)
        return torch.zeros(nbytes, dtype=torch.uint8)
    monkeypatch.setattr(tiers, "_new_slab", new_slab)
    arena = tiers.HostArena(5 * ALIGN, ALIGN, pin=True)
    arena.wait()  # the first full: the second is pinned
    assert made == ["MainThread", "hypic-host-pin"]  # and no third while the second is not taken
    assert arena.grow()  # taken: the third is pinned
    arena.wait()
    assert made == ["MainThread"] + ["hypic-host-pin"] * 2 and len(arena.slabs) == 2
    arena.close()
    assert made == ["MainThread"] + ["hypic-host-pin"] * 2  # of a budget of five


def test_a_slab_the_host_cannot_allocate_ends_the_growth_not_the_engine(monkeypatch, caplog) -> None:
    lay = layout()
    entry, real_empty, slabs = lay.entry_bytes(LEN), torch.empty, []

    def empty(*args, **kwargs):
        if args == (2 * entry,) and kwargs.get("dtype") is torch.uint8:
            slabs.append(args)
            if len(slabs) == 2:
                raise RuntimeError("out of memory")
        return real_empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    store = SegmentStore(lay, entry, "cpu", LowerTiers(6 * entry, torch.device("cpu"), None, 2 * entry))
    fill(store, "abcd")  # c's demotion finds no second slab: the first one's LRU entry makes room
    assert "cannot allocate another" in caplog.text and store.lower.capacity_bytes == 2 * entry
    assert [store.tier(key(name)) for name in "abcd"] == [None, "host", "host", "pool"]
    assert store.lower.stats().evictions == 1 and store.lower.stats().bytes == 2 * entry


def test_close_stops_the_pinning_and_lets_every_slab_go(monkeypatch) -> None:
    made = []

    def new_slab(nbytes: int, pin: bool) -> torch.Tensor:
        if threading.current_thread().name == "hypic-host-pin":
            arena._closed.wait()  # this slab is being pinned when the engine closes
        made.append(torch.zeros(nbytes, dtype=torch.uint8))
        return made[-1]
    monkeypatch.setattr(tiers, "_new_slab", new_slab)
    arena = tiers.HostArena(4 * ALIGN, ALIGN, pin=True)
    assert not arena.grow()  # the pinning starts; the next slab is not pinned yet
    arena.close()
    assert len(made) == 2 and not arena._pinner.is_alive()  # the slab under way finished, no other began
    assert arena.slabs == () and arena.allocated_bytes == arena.capacity_bytes == 0 and not arena.grow()
    slabs = [weakref.ref(slab) for slab in made]
    made.clear()
    assert all(slab() is None for slab in slabs)  # the one taken and the one pinned ahead


def test_closed_tiers_hold_no_host_memory_keep_their_counters_and_the_disk_its_files(tmp_path) -> None:
    store = tiered(pool=1, host=2, disk_dir=tmp_path)
    fill(store, "abc")  # a and b go down to host memory and to disk
    before = store.lower.stats()
    store.lower.close()
    after = store.lower.stats()
    assert (after.entries, after.bytes, after.capacity_bytes, after.pinned) == (0, 0, 0, 0)
    counters = ("demotions", "hits", "evictions")
    assert [getattr(after, c) for c in counters] == [getattr(before, c) for c in counters] != [0, 0, 0]
    assert store.lower.arena.slabs == () and [store.tier(key(n)) for n in "abc"] == ["disk", "disk", "pool"]
    restarted = DiskTier(tmp_path, 1 << 30, "fp", store.layout)
    assert key("a") in restarted and key("b") in restarted


def test_the_read_rate_is_probed_once_kept_beside_the_files_then_measured_from_reads(tmp_path) -> None:
    store = tiered(pool=1, host=1, disk_dir=tmp_path)
    disk = store.lower.disk
    assert disk.probed and disk.read_bytes_per_s > 0
    assert kept_rates(disk.rates_path) == {READ_RATE: disk.read_bytes_per_s}
    fill(store, "abc")  # a on disk only
    assert_holds(store, "a", random_tuple(store.layout, LEN, seed=ord("a")), "disk")
    meter = disk.meter
    assert meter.nbytes == store.layout.entry_bytes(LEN) and meter.busy_s > 0
    assert disk.read_bytes_per_s == meter.nbytes / meter.busy_s == disk.stats().read_bytes_per_s  # its reads' now
    store.lower.close()
    again = DiskTier(tmp_path, 1 << 30, "fp", store.layout)
    assert not again.probed and again.read_bytes_per_s == meter.nbytes / meter.busy_s


def test_disk_reads_land_in_host_memory_the_tier_holds_and_allocate_nothing(tmp_path, monkeypatch) -> None:
    """Each read is given a view of the host arena's slabs; the arena takes no slab for it, and the
    reader threads make no tensor (a pinned one would hold the CUDA driver's lock)."""
    store = tiered(pool=1, host=3, disk_dir=tmp_path)
    tuples = fill(store, "abcdef")  # f in the pool, c-e in host memory, a and b on disk only
    arena, disk = store.lower.arena, store.lower.disk
    arena.fill()
    slabs, allocated = arena.slabs, arena.allocated_bytes
    given, made = [], []
    start_read, empty = disk.start_read, torch.empty

    def spied_read(k, dst):
        given.append(dst)
        return start_read(k, dst)

    def spied_empty(*args, **kwargs):
        made.append(threading.current_thread().name)
        return empty(*args, **kwargs)
    monkeypatch.setattr(disk, "start_read", spied_read)
    monkeypatch.setattr(torch, "empty", spied_empty)
    assert store.start_read(key("a")) and store.start_read(key("b"))
    store.lower.drain()
    assert set(store.finished_reads()) == {key("a"), key("b")}
    assert [store.lower.tier(key(n)) for n in "ab"] == ["host", "host"]  # in place of c and d
    monkeypatch.undo()
    assert not [name for name in made if name.startswith("hypic-disk-read")]
    assert arena.allocated_bytes == allocated and all(a is b for a, b in zip(arena.slabs, slabs, strict=True))
    inside = [any(s.data_ptr() <= d.data_ptr() and d.data_ptr() + d.numel() <= s.data_ptr() + s.numel()
                  for s in slabs) for d in given]
    assert len(given) == 2 and all(inside)
    for name in "ab":
        assert_holds(store, name, tuples[name], "disk")  # the first claim of a read entry is a disk hit
    store.lower.drain()  # the write of f, demoted meanwhile, pins its host entry until done
    assert store.lower.stats().pinned == 0 and store.lower.disk.stats().hits == 2


@pytest.mark.gpu
def test_on_a_gpu_disk_reads_pin_no_memory(tmp_path) -> None:
    """torch's own count of pinned allocations (cudaHostAlloc) does not move while entries are read
    from disk and promoted: they land in the host arena's slabs, pinned before."""
    lay = layout(state_dtype=torch.bfloat16, model_dtype=torch.bfloat16)
    store = SegmentStore(lay, lay.entry_bytes(LEN), "cuda", LowerTiers(3 * lay.entry_bytes(LEN), torch.device("cuda"),
                                                                        DiskTier(tmp_path, 1 << 30, "fp", lay)))
    tuples = fill(store, "abcdef")
    store.lower.arena.fill()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    for name in "ab":
        entry = get(store, key(name))
        assert entry.source == "disk"
        entry.ready.synchronize()
        expected = SegmentStore(lay, lay.entry_bytes(LEN), "cpu")
        expected.put(key(name), tuples[name])
        assert torch.equal(store._bytes(entry).cpu(), expected._bytes(expected.get(key(name))))
        store.unpin(entry)
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before
    store.lower.close()


@pytest.mark.gpu
def test_on_a_gpu_copies_run_on_a_side_stream_and_entries_land_intact() -> None:
    lay = layout(state_dtype=torch.bfloat16, model_dtype=torch.bfloat16)
    store = SegmentStore(lay, 2 * lay.entry_bytes(LEN), "cuda",  # a slab per entry: the second pinned off-thread
                         LowerTiers(4 * lay.entry_bytes(LEN), torch.device("cuda"), None, lay.entry_bytes(LEN)))
    tuples = {n: random_tuple(lay, LEN, seed=ord(n)) for n in "abcd"}
    for name, tup in tuples.items():
        assert store.put(key(name), SegmentTuple(tup.interior, *[[t.cuda() for t in getattr(tup, part)]
                                                                 for part in ("T", "S0", "conv_tail", "K", "V")]))
        store.lower.arena.wait()
    arena = store.lower.arena
    assert store.stats().demotions == 2 and len(arena.slabs) == 2 and all(s.is_pinned() for s in arena.slabs)
    entry = store.get(key("a"))
    assert entry.source == "host" and entry.ready is not None  # queued on the side stream, not done inline
    entry.ready.synchronize()
    assert entry.landed
    expected = SegmentStore(lay, lay.entry_bytes(LEN), "cpu")
    expected.put(key("a"), tuples["a"])
    assert torch.equal(store._bytes(entry).cpu(), expected._bytes(expected.get(key("a"))))
    store.unpin(entry)
    store.lower.drain()
    assert store.lower.stats().pinned == 0 and store.stats().pinned == 0


@pytest.mark.gpu
def test_on_a_gpu_a_full_pool_evicts_one_entry_to_take_one_in() -> None:
    """The evicted entry's demotion copy is waited for (on the device), not evicted around: a pool
    that evicted on while the copies ran would demote every entry for each new one."""
    lay = layout(state_dtype=torch.bfloat16, model_dtype=torch.bfloat16)
    entry = lay.entry_bytes(LEN)
    store = SegmentStore(lay, 3 * entry, "cuda", LowerTiers(8 * entry, torch.device("cuda"), None, 8 * entry))
    for name in "abcd":
        tup = random_tuple(lay, LEN, seed=ord(name))
        assert store.put(key(name), SegmentTuple(tup.interior, *[[t.cuda() for t in getattr(tup, part)]
                                                                 for part in ("T", "S0", "conv_tail", "K", "V")]))
    assert store.stats().evictions == 1 and store.stats().entries == 3
    assert [store.tier(key(name)) for name in "abcd"] == ["host", "pool", "pool", "pool"]
    store.lower.drain()
    assert store.lower.stats().demotions == 1 and store.stats().pinned == 0


def test_host_tier_budget_defaults() -> None:
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert segment_host_bytes(EngineConfig(), cpu, 1 << 30) == 0  # off on a CPU engine unless asked for
    assert segment_host_bytes(EngineConfig(segment_host_bytes=5 << 20), cpu, 1 << 30) == 5 << 20
    assert segment_host_bytes(EngineConfig(), gpu, 1 << 20) == 10 << 20  # ten pools
    assert segment_host_bytes(EngineConfig(segment_host_bytes=0), gpu, 1 << 20) == 0
    assert segment_host_bytes(EngineConfig(), gpu, 1 << 50) < 1 << 50  # never more than the host has


def test_each_key_reports_its_best_tier_once_it_moves(tmp_path) -> None:
    store = tiered(pool=1, host=2, disk_dir=tmp_path)
    fill(store, "a")
    assert store.take_moves() == {key("a"): "pool"} and store.take_moves() == {}
    fill(store, "b")  # a goes down to host memory (and is written to disk)
    assert store.take_moves() == {key("a"): "host", key("b"): "pool"}
    fill(store, "cd")  # b and c down to host; a leaves host memory, on disk only now
    assert store.take_moves() == {key("a"): "disk", key("b"): "host", key("c"): "host", key("d"): "pool"}
    assert [store.tier(key(n)) for n in "abcde"] == ["disk", "host", "host", "pool", None]
    entry = get(store, key("a"))  # read into host memory in b's place, promoted; d down to host in c's
    store.unpin(entry)
    assert store.take_moves() == {key("a"): "pool", key("b"): "disk", key("c"): "disk", key("d"): "host"}


def test_without_lower_tiers_an_eviction_reports_the_key_gone() -> None:
    lay = layout()
    store = SegmentStore(lay, lay.entry_bytes(LEN), "cpu")
    for name in "ab":
        assert store.put(key(name), random_tuple(lay, LEN, seed=ord(name)))
    assert store.take_moves() == {key("a"): None, key("b"): "pool"}


def in_memory_weights() -> dict[str, torch.Tensor]:
    return {"b": torch.randn(4, 8).to(torch.bfloat16), "a": torch.arange(6), "scalar": torch.tensor(2.0)}


def test_the_weights_digest_of_in_memory_tensors_covers_their_contents(tmp_path) -> None:
    weights, memo = in_memory_weights(), tmp_path / "memo.json"
    assert weights_digest(tmp_path, weights, memo) == weights_digest(tmp_path, dict(weights), memo)
    changed = dict(weights, a=torch.arange(6) + 1)
    assert weights_digest(tmp_path, changed, memo) != weights_digest(tmp_path, weights, memo)


@pytest.mark.gpu
def test_the_weights_digest_of_device_tensors_is_that_of_their_host_copies(tmp_path) -> None:
    weights, memo = in_memory_weights(), tmp_path / "memo.json"
    on_gpu = {name: tensor.cuda() for name, tensor in weights.items()}
    assert weights_digest(tmp_path, on_gpu, memo) == weights_digest(tmp_path, weights, memo)
