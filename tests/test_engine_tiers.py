"""The segment pool's host and disk tiers through the engine, on CPU: the same outputs as an unbounded
pool, lower-tier hits reported as such, faults on disk cost a recompute, other weights never read;
a request looks its documents up (pins, promotes) only when the scheduler is about to take it."""
from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from concurrent.futures import Executor, Future

import pytest
import torch
from conftest import make_model_dir
from engine_util import GPU_SHARE, collect, cpu_config, greedy

from hypic import AsyncEngine
from hypic.cache.disk_tier import DiskTier
from hypic.engine import setup
from hypic.engine.llm_engine import ADMISSION_LOOKAHEAD, LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.sequence import Sequence
from hypic.kernels.host_copy import sync_sites

SEP = "<|segment|>"
SYSTEM = "Position-independent caching reuses documents at any position in the prompt."
DOCS = ("the quick brown fox jumps over the lazy dog. hello world, héllo 世界 " * 2,
        "Grüße aus Köln! naïve café résumé — the separator is removed. 1234 5678 90 " * 2,
        "A segment is tokenized on its own; caching reuses documents at any position. " * 2)


# more documents than a tight pool holds, of one length (entries of one size: no hole of a pinned
# pool is too small for another)
CORPUS = tuple(f"document {i}: {DOCS[0]}" for i in range(6))


def jobs(rounds: int = 2) -> list[str]:
    """Each document once per round, each time with another question (no exact-prefix hit)."""
    return [SEP.join([SYSTEM, doc, f"question {r} about document {i}?"]) for r in range(rounds)
            for i, doc in enumerate(DOCS)]


def serve(config, prompts, before=None):
    """Requests one at a time (identical batches); returns the outputs and the engine core."""
    async def main():
        async with AsyncEngine(config) as engine:
            if before is not None:
                before(engine.core)
            outs = [await collect(engine, p, greedy(3, logprobs=0)) for p in prompts]
            if engine.core.store.lower is not None:
                engine.core.store.lower.drain()
            return outs, engine.core
    return asyncio.run(main())


def tier_config(model_dir, **overrides):
    return cpu_config(model_dir, **{"seam_width": 4, "cpu_cache_bytes": 32 << 20, **overrides})


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """An unbounded pool's outputs, and the bytes of one entry (the three are of similar size)."""
    outs, core = serve(tier_config(tiny_model_dir), jobs())
    stats = core.store.stats()
    assert stats.evictions == 0 and stats.entries == len(DOCS)
    return outs, stats.bytes // len(DOCS)


def kinds(outs) -> list[set[str]]:
    return [set(o.metrics.cached_tokens_by_kind) - {"prefix"} for o in outs]


def assert_same_outputs(outs, reference_outs) -> None:
    assert [o.tokens for o in outs] == [o.tokens for o in reference_outs]
    assert [lp.logprob for o in outs for lp in o.logprobs[0]] == pytest.approx(
        [lp.logprob for o in reference_outs for lp in o.logprobs[0]], abs=1e-6)


def test_a_host_tier_turns_pool_evictions_into_hits_with_identical_outputs(tiny_model_dir, reference):
    ref, entry = reference
    tight = dict(segment_pool_bytes=entry * 3 // 2)  # room for one entry
    without, core = serve(tier_config(tiny_model_dir, **tight), jobs())
    assert core.store.stats().evictions >= 4
    assert kinds(without)[len(DOCS):] == [set()] * len(DOCS)  # every second look recomputes
    tiered, core = serve(tier_config(tiny_model_dir, segment_host_bytes=entry * 4, **tight), jobs())
    assert_same_outputs(tiered, ref)
    assert_same_outputs(without, ref)
    assert kinds(tiered)[len(DOCS):] == [{"pic_host"}] * len(DOCS)
    host, pool = core.store.lower.stats(), core.store.stats()
    assert host.promotions == host.hits == len(DOCS) and pool.promotions == len(DOCS)
    assert pool.demotions == pool.evictions and host.demotions == len(DOCS)  # a promoted entry is kept below


def test_pinned_entries_leave_no_room_so_the_request_recomputes(tiny_model_dir, reference):
    ref, entry = reference
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 4)
    prompts = jobs()

    async def main():
        async with AsyncEngine(config) as engine:
            store = engine.core.store
            first = [await collect(engine, p, greedy(3, logprobs=0)) for p in prompts[:2]]
            held = store.get(next(iter(store._index)))  # document 1, the pool's only entry, stays pinned
            again = await collect(engine, prompts[len(DOCS)], greedy(3, logprobs=0))  # document 0: in host
            store.unpin(held)
            return first + [again], store
    outs, store = asyncio.run(main())
    assert kinds(outs) == [set()] * 3  # nothing could be promoted into the pinned pool
    exact, _ = serve(tier_config(tiny_model_dir, cache_mode="none"), [prompts[len(DOCS)]])
    assert_same_outputs(outs, ref[:2] + exact)  # the segment was computed in full (nor stored: no room)
    assert store.lower.stats().hits == 1 and store.lower.stats().promotions == 0
    assert store.stats().no_room == 2  # the promotion, then the store of the recomputed tuple
    assert store.stats().pinned == store.lower.stats().pinned == 0


def test_disk_tier_survives_a_restart_and_faults_cost_a_recompute(tiny_model_dir, reference, tmp_path):
    ref, entry = reference
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 3 // 2,
                         segment_disk_dir=tmp_path)
    serve(config, jobs(1))  # documents 0 and 1 are demoted, so written to disk
    files = sorted(tmp_path.glob("*/*.seg"))
    assert len(files) == 2
    warm, core = serve(config, jobs()[len(DOCS):])
    assert_same_outputs(warm, ref[len(DOCS):])
    assert kinds(warm)[:2] == [{"pic_disk"}] * 2
    disk = core.store.lower.disk.stats()
    assert disk.hits == 2 and disk.errors == 0 and disk.read_bytes_per_s > 0


def test_corrupt_truncated_or_missing_disk_entries_are_recomputed_correctly(tiny_model_dir, reference, tmp_path):
    ref, entry = reference
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 3 // 2,
                         segment_disk_dir=tmp_path)
    extra = SEP.join([SYSTEM, "one more document, so that all three are demoted " * 3, "?"])
    serve(config, jobs(1) + [extra])
    files = sorted(tmp_path.glob("*/*.seg"))
    assert len(files) == len(DOCS)

    def damage(core: LLMEngine) -> None:  # after start-up, so the index still lists every file
        corrupt, truncate, delete = files
        data = bytearray(corrupt.read_bytes())
        data[-7] ^= 0xFF
        corrupt.write_bytes(data)
        truncate.write_bytes(truncate.read_bytes()[:-1000])
        delete.unlink()

    warm, core = serve(config, jobs()[len(DOCS):], before=damage)
    assert_same_outputs(warm, ref[len(DOCS):])
    assert kinds(warm) == [set()] * len(DOCS)
    assert core.store.lower.disk.stats().errors == len(DOCS)


def test_other_weights_with_the_same_config_never_read_the_directory(tiny_model_dir, reference, tmp_path_factory,
                                                                      tmp_path):
    _, entry = reference
    other = make_model_dir(tmp_path_factory.mktemp("other_weights"), seed=1)
    assert (other / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    tight = dict(segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 3 // 2, segment_disk_dir=tmp_path)
    serve(tier_config(tiny_model_dir, **tight), jobs(1))
    warm, core = serve(tier_config(other, **tight), jobs()[len(DOCS):])
    assert kinds(warm)[:2] == [set()] * 2
    assert core.store.lower.disk.stats().hits == 0
    assert len(list(tmp_path.iterdir())) == 3  # two identities' directories and the weights digests


def test_every_tier_gives_back_its_pins_after_aborts(tiny_model_dir, reference):
    _, entry = reference
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 2)

    async def main():
        async with AsyncEngine(config) as engine:
            prompts = jobs(3)
            for p in prompts[:len(DOCS)]:  # one at a time: the pool evicts, the host tier fills
                await collect(engine, p, greedy(1))
            tasks = [asyncio.create_task(collect(engine, p, greedy(20))) for p in prompts[len(DOCS):]]
            await asyncio.sleep(0)
            for task in tasks[::2]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            while engine.core.has_work():
                await asyncio.sleep(0.01)
            engine.core.store.lower.drain()
            return engine.core
    core = asyncio.run(main())
    pool, host = core.store.stats(), core.store.lower.stats()
    assert pool.pinned == 0 and host.pinned == 0
    assert pool.bytes == sum(e.nbytes for e in core.store._index.values())
    assert host.bytes == sum(h.nbytes for h in core.store.lower._index.values())
    assert pool.evictions > 0 and host.hits > 0 and core.stats().requests_aborted > 0


def rag(*docs: str, question: str = "what do they say?") -> str:
    return SEP.join([SYSTEM, *docs, question])


QUEUED = [rag(CORPUS[i], CORPUS[(i + 1) % len(CORPUS)]) for i in range(len(CORPUS))]  # twice the corpus


@pytest.fixture(scope="module")
def corpus(tiny_model_dir):
    """An unbounded pool's outputs of QUEUED (one at a time), and the bytes of one CORPUS entry."""
    outs, core = serve(tier_config(tiny_model_dir), QUEUED)
    stats = core.store.stats()
    assert stats.entries == len(CORPUS)
    return outs, stats.bytes // len(CORPUS)


def add(engine: LLMEngine, text: str, params=None, **kwargs) -> Sequence:
    """Queue a request on the engine itself (no loop around it); its first sequence."""
    prompt = SegmentedPrompt.build(engine.tokenizer, text, separator=SEP)
    rid = engine.add_request(prompt, params or greedy(3), **kwargs)
    return engine.requests[rid].completions[0].seq


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()
    if engine.store.lower is not None:
        engine.store.lower.drain()


def warmed(config, docs) -> LLMEngine:
    """An engine that served one request per document, one at a time, every copy and write done."""
    engine = LLMEngine(config)
    for doc in docs:
        add(engine, rag(doc), greedy(1))
        run_to_end(engine)
    return engine


def segment_keys(engine: LLMEngine, text: str) -> list:
    return [job.key for job in engine.segment_jobs(SegmentedPrompt.build(engine.tokenizer, text, separator=SEP))]


def pic_hit_tokens(seq: Sequence) -> int:
    return sum(n for kind, n in seq.info.cached_tokens_by_kind.items() if kind != "prefix")


def test_queued_requests_hold_no_pool_so_the_admitted_ones_promote_instead_of_recomputing(tiny_model_dir, corpus):
    """Six requests queued at once want twelve entries of a pool that holds two: each looks its
    documents up only when the scheduler is about to take it, so every document is a hit (most
    from the host tier) and no promotion finds the pool pinned full (no_room) and recomputes."""
    unbounded, entry = corpus
    engine = warmed(tier_config(tiny_model_dir, segment_pool_bytes=entry * 5 // 2, segment_host_bytes=entry * 8),
                    CORPUS)
    host_hits = engine.store.lower.stats().hits
    seqs = [add(engine, p) for p in QUEUED]
    assert sum(s.pic.attached for s in seqs) < len(seqs)  # the pool's room, not the queue, decides
    run_to_end(engine)
    interiors = [sum(j.interior[1] - j.interior[0] for j in engine.segment_jobs(s.info.prompt)) for s in seqs]
    assert [pic_hit_tokens(s) for s in seqs] == interiors
    assert engine.store.stats().no_room == 0 and engine.store.lower.stats().hits - host_hits >= len(CORPUS)
    assert [s.output_ids for s in seqs] == [o.tokens for o in unbounded]
    assert engine.store.stats().pinned == engine.store.lower.stats().pinned == 0


def test_a_request_is_admitted_while_the_one_before_it_waits_for_its_disk_read(tiny_model_dir, corpus, tmp_path):
    """The first request's document is read off the disk on a thread (into host memory, in place of
    the least recently used host entry); the second one's comes from the host tier: it runs in the
    first step, whatever the read does meanwhile."""
    _, entry = corpus
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 5 // 2, segment_host_bytes=entry * 5 // 2,
                         segment_disk_dir=tmp_path)
    engine = warmed(config, CORPUS[:5])  # pool: documents 3 and 4; host: 1 and 2; disk: 0, 1 and 2
    engine.pic.costs.read_bytes_per_s = lambda: 1e15  # read, never recompute
    assert [engine.store.tier(segment_keys(engine, rag(doc))[0]) for doc in CORPUS[:3]] == ["disk", "host", "host"]
    first, second = add(engine, rag(CORPUS[0], question="first?")), add(engine, rag(CORPUS[2], question="second?"))
    engine.step()
    assert second.num_computed > 0
    run_to_end(engine)
    assert [set(s.info.cached_tokens_by_kind) - {"prefix"} for s in (first, second)] == [{"pic_disk"}, {"pic_host"}]
    assert engine.store.stats().no_room == 0 and engine.store.stats().pinned == 0
    engine.close()


def test_a_request_pushed_out_of_the_look_ahead_gives_its_pins_back_and_aborts_leave_nothing(tiny_model_dir,
                                                                                             corpus):
    """One seat, held by a decode: a batch's first ADMISSION_LOOKAHEAD requests look their documents
    up; a later request whose turn comes before the batch's second pushes the last of them out,
    which unpins its document. Aborts of looked-up, pushed-out and running requests leave no pin."""
    _, entry = corpus
    engine = warmed(tier_config(tiny_model_dir, max_num_seqs=1, segment_pool_bytes=entry * 8), CORPUS)
    decoder = add(engine, "hello world", greedy(100), cache_mode="none")
    engine.step()
    batch = [add(engine, rag(doc), group="batch") for doc in CORPUS[:ADMISSION_LOOKAHEAD + 1]]
    assert [s.pic.attached for s in batch] == [True] * ADMISSION_LOOKAHEAD + [False]
    alone = add(engine, rag(CORPUS[ADMISSION_LOOKAHEAD + 1]))
    assert [s.pic.attached for s in batch] == [True] * (ADMISSION_LOOKAHEAD - 1) + [False, False] and alone.pic.attached
    pinned = [engine.store.pinned(segment_keys(engine, rag(doc))[0]) for doc in CORPUS[:ADMISSION_LOOKAHEAD + 2]]
    assert pinned == [True] * (ADMISSION_LOOKAHEAD - 1) + [False, False, True]
    for seq in (batch[0], batch[-1], decoder):
        engine.abort(seq.info.request_id)
    run_to_end(engine)
    assert all(s.finished for s in (*batch, alone)) and pic_hit_tokens(alone) > 0
    stats = engine.store.stats()
    assert stats.pinned == 0 and stats.bytes == sum(e.nbytes for e in engine.store._index.values())
    assert not engine.pic.jobs and not any(engine.pic.waiters.values())


def disk_warmed(tiny_model_dir, reference, tmp_path):
    """A disk directory holding documents 0 and 1 (demoted through a one-entry pool and host tier)."""
    ref, entry = reference
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 3 // 2,
                         segment_disk_dir=tmp_path)
    serve(config, jobs(1))
    return ref, config


@pytest.mark.parametrize("read_bytes_per_s, kind", [(1.0, set()), (1e15, {"pic_disk"})])
def test_a_disk_entry_slower_to_read_than_to_recompute_is_recomputed(tiny_model_dir, reference, tmp_path, caplog,
                                                                     read_bytes_per_s, kind):
    ref, config = disk_warmed(tiny_model_dir, reference, tmp_path)
    caplog.set_level(logging.INFO, logger="hypic")

    def disk_speed(core: LLMEngine) -> None:  # the injected read rate; the prefill rate as it is measured
        core.pic.costs.read_bytes_per_s = lambda: read_bytes_per_s
    warm, core = serve(config, jobs()[len(DOCS):], before=disk_speed)
    assert_same_outputs(warm, ref[len(DOCS):])
    assert kinds(warm)[:2] == [kind] * 2
    disk = core.stats().segment_disk
    assert (disk.hits, disk.recomputed) == ((0, 2) if read_bytes_per_s == 1.0 else (2, 0))
    assert disk.recompute_tokens_per_s == core.pic.costs.tokens_per_s > 0
    per_segment = core.store.layout.entry_bytes(1024)
    capacities = (config.segment_pool_bytes // per_segment, config.segment_host_bytes // per_segment,
                  disk.capacity_bytes // per_segment)
    line = "segment tiers (1k-token segments): " + ", ".join(
        f"{name} {n}" for name, n in zip(("pool", "host", "disk"), capacities))  # every tier is on
    assert any(line + " (disk reads " in r.getMessage() and " GB/s)" in r.getMessage() for r in caplog.records)


def test_shutdown_lets_host_memory_go_and_the_next_engine_starts_from_the_kept_prefill_rate(tiny_model_dir,
                                                                                            reference, tmp_path):
    _, entry = reference
    config = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 4,
                         segment_disk_dir=tmp_path)
    slabs = []
    _, core = serve(config, jobs(1), before=lambda core: slabs.extend(map(weakref.ref, core.store.lower.arena.slabs)))
    assert slabs and all(slab() is None for slab in slabs)  # gone with the shutdown, though the core lives on
    assert core.store.lower.stats().entries == 0 and core.store.lower.stats().demotions > 0
    assert core.pic.costs.measured
    restarted = LLMEngine(config)
    assert restarted.pic.costs.tokens_per_s == core.pic.costs.tokens_per_s and not restarted.pic.costs.measured
    restarted.close()


def test_the_read_and_prefill_rates_persist_across_a_restart(tiny_model_dir, reference, tmp_path):
    """The first engine probes the directory's read rate (nothing is kept yet); the second starts
    from it and measures its own from its reads; the third starts from the second's rates, probing
    nothing."""
    ref, config = disk_warmed(tiny_model_dir, reference, tmp_path)
    warm, second = serve(config, jobs()[len(DOCS):])
    assert_same_outputs(warm, ref[len(DOCS):])
    assert kinds(warm)[:2] == [{"pic_disk"}] * 2
    disk = second.store.lower.disk
    assert not disk.probed and disk.meter.bytes_per_s == disk.read_bytes_per_s and second.pic.costs.measured
    third = LLMEngine(config)
    assert not third.store.lower.disk.probed
    assert third.store.lower.disk.read_bytes_per_s == disk.read_bytes_per_s
    assert third.pic.costs.tokens_per_s == second.pic.costs.tokens_per_s
    third.close()


class HeldReads(Executor):
    """A disk whose reads are done only when the test says (`finish`): as slow as a test wants it,
    without sleeping."""

    def __init__(self) -> None:
        self.held: list[tuple[Future, functools.partial]] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()
        self.held.append((future, functools.partial(fn, *args, **kwargs)))
        return future

    def finish(self) -> None:
        for future, read in self.held:
            future.set_result(read())
        self.held = []

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.finish()


def test_a_read_past_its_deadline_is_recomputed_and_lands_in_host_memory_later(tiny_model_dir, reference,
                                                                                tmp_path, monkeypatch):
    ref, config = disk_warmed(tiny_model_dir, reference, tmp_path)
    reads = HeldReads()
    monkeypatch.setattr(setup, "DiskTier", functools.partial(DiskTier, readers=reads))
    engine = LLMEngine(config)
    now = [0.0]
    engine.pic.costs.clock = lambda: now[0]
    engine.pic.costs.read_bytes_per_s = lambda: 1e15  # read, whatever the prefill rate
    prompt = jobs()[len(DOCS)]  # document 0 again: on disk only
    [key] = segment_keys(engine, prompt)
    seq = add(engine, prompt, greedy(3, logprobs=0))
    outs = [*engine.step(), *engine.step()]
    assert seq.num_computed == 0 and len(reads.held) == 1 and key in engine.pic.reads  # waits for its read
    now[0] = engine.pic.reads[key] + 1e-3  # the read is late
    while engine.has_work():
        outs += engine.step()
    assert seq.finished and len(reads.held) == 1  # done while the read never finished
    assert [t for o in outs for d in o.deltas for t in d.token_ids] == ref[len(DOCS)].tokens
    assert [lp.logprob for o in outs for d in o.deltas for lp in d.logprobs] == pytest.approx(
        [lp.logprob for lp in ref[len(DOCS)].logprobs[0]], abs=1e-6)
    assert set(seq.info.cached_tokens_by_kind) - {"prefix"} == set()  # recomputed, not a disk hit
    reads.finish()
    engine.step()  # lands the read
    assert engine.store.lower.tier(key) == "host" and engine.store.tier(key) == "pool"
    disk = engine.stats().segment_disk
    assert (disk.late, disk.recomputed, disk.hits, disk.errors) == (1, 0, 1, 0)
    engine.close()


def test_a_peer_pulling_an_entry_held_only_on_disk_gets_it_read(tiny_model_dir, reference, tmp_path):
    _, config = disk_warmed(tiny_model_dir, reference, tmp_path)
    unbounded = tier_config(tiny_model_dir)

    async def exported(engine_config, prompt):
        async with AsyncEngine(engine_config) as engine:
            job = engine.segment_jobs(prompt)[0]
            if engine_config is unbounded:
                await engine.build_segments([job])
            tier = engine.core.store.tier(job.key)
            return tier, await engine.export_segment(job.key), engine.core.store.stats()
    tier, from_disk, pool = asyncio.run(exported(config, jobs()[0]))
    assert tier == "disk" and pool.entries == 1 and pool.promotions == 1  # promoted on the way out
    _, built, _ = asyncio.run(exported(unbounded, jobs()[0]))
    assert from_disk.interior == built.interior
    for name in ("T", "S0", "conv_tail", "K", "V"):
        for got, want in zip(getattr(from_disk, name), getattr(built, name), strict=True):
            torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)


@pytest.mark.gpu
def test_on_a_gpu_host_and_disk_hits_give_the_outputs_of_an_unbounded_pool(tiny_model_dir, tmp_path):
    gpu = dict(device="cuda", dtype="float32", gpu_memory_utilization=GPU_SHARE)
    ref, core = serve(tier_config(tiny_model_dir, **gpu), jobs())
    entry = core.store.stats().bytes // len(DOCS)
    tight = tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 4,
                        segment_disk_dir=tmp_path, **gpu)
    pinned = []  # looked at while it serves: a shutdown lets the slabs go

    def slabs_pinned(core: LLMEngine) -> None:
        pinned.extend(slab.is_pinned() for slab in core.store.lower.arena.slabs)
    tiered, core = serve(tight, jobs(), before=slabs_pinned)
    assert_same_outputs(tiered, ref)
    assert kinds(tiered)[len(DOCS):] == [{"pic_host"}] * len(DOCS)  # copied up on the side stream
    assert pinned and all(pinned)
    restarted, core = serve(tight, jobs()[len(DOCS):])
    assert_same_outputs(restarted, ref[len(DOCS):])
    assert kinds(restarted) == [{"pic_disk"}] * len(DOCS)  # read into the pinned host arena, then copied up
    assert core.store.stats().pinned == core.store.lower.stats().pinned == 0


@pytest.mark.gpu
def test_on_a_gpu_promotions_and_demotions_never_make_the_host_wait_for_the_device(tiny_model_dir):
    """Torch's sync debug mode names every host sync of admitting and stepping warm requests whose
    documents come back from host memory (copied up on the side stream) while others go down: none
    is in the tiers' code."""
    gpu = dict(device="cuda", dtype="float32", gpu_memory_utilization=GPU_SHARE)
    _, core = serve(tier_config(tiny_model_dir, **gpu), jobs(1))
    entry = core.store.stats().bytes // len(DOCS)
    engine = LLMEngine(tier_config(tiny_model_dir, segment_pool_bytes=entry * 3 // 2, segment_host_bytes=entry * 4,
                                   **gpu))

    def one_at_a_time(prompts: list[str]) -> list[str]:
        sites = []
        for prompt in prompts:
            segmented = SegmentedPrompt.build(engine.tokenizer, prompt, separator=engine.config.segment_separator)
            sites += sync_sites(lambda: engine.add_request(segmented, greedy(3)))
            while engine.has_work():
                sites += sync_sites(engine.step)
        return sites
    one_at_a_time(jobs(1))  # compiles and autotunes; each document goes down as the next one comes
    pool, host = engine.store.stats(), engine.store.lower.stats()
    sites = one_at_a_time(jobs()[len(DOCS):])  # each promoted back, the one before it demoted
    assert engine.store.lower.stats().promotions - host.promotions == len(DOCS)
    assert engine.store.stats().demotions > pool.demotions
    assert [s for s in sites if any(name in s for name in ("tiers.py", "segment_store.py", "disk_tier.py"))] == []
    engine.close()
