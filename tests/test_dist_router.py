"""Router decisions: combine node choice, pulls over recomputation, LPT of cold segments, affinity."""
from __future__ import annotations

import pytest

from hypic.cache.prefix_cache import token_bytes
from hypic.cache.segment_store import SegmentKey
from hypic.dist.affinity import AffinityMap, prefix_hashes
from hypic.dist.config import DistConfig
from hypic.dist.directory import SegmentDirectory
from hypic.dist.router import NodeLoad, Router
from hypic.engine.pic.plan import SegmentJob


def seg(name: str, tokens: int) -> SegmentJob:
    ids = tuple(range(tokens))
    return SegmentJob(SegmentKey.of("fp", 8, name, token_bytes(ids)), ids, (8, tokens - 8), False)


def nodes(*loads: int) -> list[NodeLoad]:
    return [NodeLoad(i, load, 0) for i, load in enumerate(loads)]


def router(**overrides) -> Router:
    return Router(DistConfig(**{"min_remote_tokens": 0, **overrides}))


def test_cold_segments_are_spread_lpt_over_all_nodes_combine_included():
    r = router()
    segments = [seg("a", 2400), seg("b", 1200), seg("c", 1200), seg("d", 2400)]
    placements = r.place(segments, combine=0, nodes=nodes(0, 0, 0))
    assert all(p.kind == "build" for p in placements)
    loads = {}
    for p in placements:
        loads[p.source] = loads.get(p.source, 0) + len(p.segment.token_ids)
    assert sorted(loads.values()) == [2400, 2400, 2400]
    assert [len(p.segment.token_ids) for p in placements] == [2400, 2400, 1200, 1200]  # largest first


def test_busy_nodes_get_less_and_small_segments_stay_on_the_combine_node():
    r = router(min_remote_tokens=500)
    placements = r.place([seg("a", 1000), seg("b", 1000), seg("tiny", 100)], combine=1, nodes=nodes(5000, 0, 0))
    by_source = {p.segment.key: p.source for p in placements}
    assert by_source[seg("tiny", 100).key] == 1
    assert 0 not in by_source.values()


def test_held_segments_are_pulled_or_used_in_place_never_recomputed():
    r = router()
    a, b, c = seg("a", 500), seg("b", 500), seg("c", 500)
    r.directory.add(a.key, 0)
    r.directory.add(b.key, 2)
    r.directory.add(b.key, 1)
    placements = {p.segment.key: p for p in r.place([a, b, c, a], combine=0, nodes=[
        NodeLoad(0, 0, 0), NodeLoad(1, 900, 0), NodeLoad(2, 100, 0)])}
    assert len(placements) == 3  # a repeated segment is fetched once
    assert placements[a.key].kind == "local"
    assert placements[b.key].kind == "pull" and placements[b.key].source == 2  # the less loaded holder
    assert placements[c.key].kind == "build"


def test_holders_outside_the_usable_set_are_ignored():
    r = router()
    a = seg("a", 500)
    r.directory.add(a.key, 5)
    [p] = r.place([a], combine=0, nodes=nodes(0, 0))
    assert p.kind == "build"


def test_combine_node_prefers_holders_and_the_conversation_node_within_the_load_slack():
    r = router(combine_load_slack_tokens=1000)
    a, b = seg("a", 2000), seg("b", 500)
    r.directory.add(a.key, 2)
    r.directory.add(b.key, 1)
    assert r.choose_combine(nodes(0, 0, 0), [a, b], []) == 2  # holds the most tokens
    assert r.choose_combine(nodes(0, 0, 5000), [a, b], []) == 1  # node 2 is too busy
    assert r.choose_combine(nodes(10, 0, 0), [], []) == 1  # nothing held: least loaded, lowest id
    r.affinity.remember([11, 12], 0)
    assert r.choose_combine(nodes(500, 0, 0), [a, b], [11, 12, 13]) == 0
    assert r.choose_combine(nodes(5000, 0, 0), [a, b], [11, 12, 13]) == 2


def test_running_requests_count_as_load():
    r = router(decode_token_weight=64)
    assert r.least_loaded([NodeLoad(0, 0, 10), NodeLoad(1, 600, 0)]) == 1


def test_prefix_hashes_extend_and_affinity_finds_the_longest_prefix():
    turn1 = list(range(150))
    turn2 = turn1 + list(range(500, 600))
    h1, h2 = prefix_hashes(turn1, "s", 64), prefix_hashes(turn2, "s", 64)
    assert len(h1) == 2 and h2[:2] == h1
    assert prefix_hashes(turn1, "other", 64)[0] != h1[0]
    affinity = AffinityMap(capacity=2)
    affinity.remember(h1, 3)
    assert affinity.lookup(h2) == 3 and affinity.lookup(prefix_hashes(list(range(9, 300)), "s", 64)) is None
    affinity.forget_node(3)
    assert affinity.lookup(h2) is None
    for i in range(3):
        affinity.remember([i], i)
    assert affinity.lookup([0]) is None and affinity.lookup([2]) == 2  # least recently used out


def test_directory_forgets_nodes_and_stays_bounded():
    d = SegmentDirectory(capacity=2)
    keys = [seg(str(i), 20).key for i in range(3)]
    for k in keys:
        d.add(k, 1)
    d.add(keys[2], 2)
    assert len(d) == 2 and d.holders(keys[0]) == frozenset()
    d.forget_node(1)
    assert d.holders(keys[2]) == {2} and d.holders(keys[1]) == frozenset()
    d.drop(keys[2], 2)
    assert len(d) == 0


def test_round_robin_baseline_ignores_sizes_and_loads():
    r = router(assignment="round_robin")
    placements = r.place([seg("a", 4000), seg("b", 100), seg("c", 4000), seg("d", 100)], combine=0,
                         nodes=nodes(0, 9000))
    assert [p.source for p in placements] == [0, 1, 0, 1]


def test_the_directory_keeps_each_holders_tier_and_follows_its_moves():
    d, a, b = SegmentDirectory(8), seg("a", 64).key, seg("b", 64).key
    d.add(a, 0)
    d.add(a, 1, "disk")
    assert (d.tier(a, 0), d.tier(a, 1), d.tier(a, 2)) == ("pool", "disk", None)
    assert [d.rank(a, n) for n in (0, 1, 2)] == [0, 2, 3]
    d.moved(0, {a: "host", b: "pool"})  # node 0 demoted a, stored b
    assert d.tier(a, 0) == "host" and d.holders(b) == {0}
    d.moved(0, {a: None})
    assert d.holders(a) == {1} and d.tier(a, 1) == "disk"
    d.forget_node(1)
    assert d.holders(a) == frozenset() and len(d) == 1


def test_a_pull_prefers_the_best_tier_then_the_least_loaded_holder():
    r, s = router(), seg("a", 64)
    r.directory.add(s.key, 1, "disk")
    r.directory.add(s.key, 2, "host")
    r.directory.add(s.key, 3, "pool")
    loads = nodes(0, 0, 0, 9000)  # the pool holder is the busiest: its tier still wins
    assert [(p.kind, p.source) for p in r.place([s], combine=0, nodes=loads)] == [("pull", 3)]
    r.directory.drop(s.key, 3)
    assert [(p.kind, p.source) for p in r.place([s], combine=0, nodes=loads)] == [("pull", 2)]
    r.directory.drop(s.key, 2)
    assert [(p.kind, p.source) for p in r.place([s], combine=0, nodes=loads)] == [("pull", 1)]
    r.directory.add(s.key, 0, "disk")  # the combine node's own disk beats any pull
    assert [(p.kind, p.source) for p in r.place([s], combine=0, nodes=loads)] == [("local", 0)]


def test_the_directory_refuses_an_unknown_tier():
    with pytest.raises(ValueError, match="none of"):
        SegmentDirectory(4).add(seg("a", 64).key, 0, "tape")
