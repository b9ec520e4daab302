"""Shared PIC test helpers: segmented prompts, engine runs on CPU, the state after a prefill, and the
claims every architecture's PIC tests make against full recompute (`none`)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from engine_util import GPU_SHARE, collect, cpu_config, greedy

from hypic import AsyncEngine, EngineConfig
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.kernels import pic_layer

SEP = "<|segment|>"
SYSTEM = "Position-independent caching reuses documents at any position in the prompt."
DOCS = ("the quick brown fox jumps over the lazy dog. hello world, héllo 世界 " * 2,
        "Grüße aus Köln! naïve café résumé — the separator is removed. 1234 5678 90 " * 2,
        "A segment is tokenized on its own; caching reuses documents at any position. " * 2)
QUERY = "hello world, the quick brown fox"


def prompt(*docs: str, query: str = QUERY) -> str:
    return SEP.join([SYSTEM, *docs, query])


def run(config, jobs):
    """Requests one after another on one engine."""
    async def main():
        async with AsyncEngine(config) as engine:
            return [await collect(engine, p, s, **kw) for p, s, kw in jobs]
    return asyncio.run(main())


def run_with_store_stats(config, jobs):
    async def main():
        async with AsyncEngine(config) as engine:
            outs = [await collect(engine, p, s, **kw) for p, s, kw in jobs]
            return outs, engine.core.store.stats()
    return asyncio.run(main())


def pic_config(model_dir, **overrides):
    return cpu_config(model_dir, **{"seam_width": 4, "cpu_cache_bytes": 32 << 20, **overrides})


def state_after_prefill(config, text: str, layer_id: int, warm_first: bool) -> dict:
    """The running state (ssm, conv window) and KV pages of a request right after its prefill."""
    engine = LLMEngine(config)
    for _ in range(2 if warm_first else 1):
        rid = engine.add_request(SegmentedPrompt.build(engine.tokenizer, text, separator=SEP), greedy(3))
        seq = engine.requests[rid].sequences[0]
        while not seq.output_ids:
            engine.step()
        snapshot = _snapshot(engine, seq, layer_id)
        engine.abort(rid)
    return snapshot


def _snapshot(engine, seq, layer_id: int) -> dict:
    caches = engine.caches
    if layer_id in caches.shape.linear_layers:
        ssm, conv = caches.state(layer_id)
        return {"ssm": ssm[seq.slot].clone(), "conv": conv[seq.slot].clone()}
    k, v = caches.kv(layer_id)
    n, bs = seq.num_computed, caches.block_size
    pages = torch.tensor(seq.block_ids)[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    return {"k": k.view(-1, *k.shape[2:])[pages], "v": v.view(-1, *v.shape[2:])[pages]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def first_layer_state(model_dir, mode: str, **overrides) -> dict:
    """Layer 0's state (or pages) after prefilling prompt(*DOCS); warm modes prefill it twice."""
    config = pic_config(model_dir, cache_mode=mode, **overrides)
    return state_after_prefill(config, prompt(*DOCS), 0, warm_first=mode != "none")


def assert_composed_first_state_exact(model_dir) -> dict:
    """Exact at layer 0 (its inputs are embeddings); returns full recompute's state."""
    full, composed = first_layer_state(model_dir, "none"), first_layer_state(model_dir, "hypic")
    assert rel(composed["ssm"], full["ssm"]) <= 1e-4
    assert rel(composed["conv"], full["conv"]) <= 1e-5
    return full


def state_error_without_conv_tails(model_dir, monkeypatch: pytest.MonkeyPatch) -> float:
    """Layer 0's ssm error against full recompute when the interiors' conv tails are zeroed."""
    full = first_layer_state(model_dir, "none")
    spliced = pic_layer.spliced_conv
    monkeypatch.setattr(pic_layer, "spliced_conv", lambda x, tails, *rest: spliced(x, tails * 0, *rest))
    return rel(first_layer_state(model_dir, "hypic")["ssm"], full["ssm"])


def assert_wide_seam_equals_none(model_dir) -> None:
    p = prompt(*DOCS)
    full, = run(pic_config(model_dir, cache_mode="none"), [(p, greedy(6, logprobs=0), {})])
    _, wide = run(pic_config(model_dir, seam_width=10_000), [(p, greedy(6, logprobs=0), {})] * 2)
    assert wide.tokens == full.tokens
    assert [x.logprob for x in wide.logprobs[0]] == pytest.approx([x.logprob for x in full.logprobs[0]], abs=1e-5)


def assert_reordered_hit_and_other_salts_miss(model_dir) -> None:
    first, reordered, other_salt = run(pic_config(model_dir), [
        (prompt(DOCS[0], DOCS[1]), greedy(2), {}), (prompt(DOCS[1], DOCS[0]), greedy(2), {}),
        (prompt(DOCS[1], DOCS[0]), greedy(2), {"cache_salt": "tenant-b"})])
    assert first.metrics.cached_tokens_by_kind.get("pic", 0) == 0
    assert reordered.metrics.cached_tokens_by_kind["pic"] > 0
    assert other_salt.metrics.cached_tokens_by_kind.get("pic", 0) == 0


def assert_scattered_first_pages_exact(model_dir) -> None:
    """Layer 0 is attention: cached interiors land in the pages exactly as full recompute writes them."""
    full, warm = first_layer_state(model_dir, "none"), first_layer_state(model_dir, "hypic")
    assert rel(warm["k"], full["k"]) <= 1e-5
    assert rel(warm["v"], full["v"]) <= 1e-5


def assert_blocks_slots_and_pins_return(model_dir) -> None:
    async def main():
        async with AsyncEngine(pic_config(model_dir)) as engine:
            await asyncio.gather(*(collect(engine, prompt(*order), greedy(3)) for order in (DOCS, DOCS[::-1])))
            return engine.core.stats()
    s = asyncio.run(main())
    assert s.kv_blocks_total - s.kv_blocks_free == s.prefix_cache.blocks_held
    assert s.state_slots_total - s.state_slots_free == s.prefix_cache.slots_held
    assert s.segment_pool.pinned == 0 and s.segment_pool.entries == 3


def engine_run(model_dir, device: str, jobs, **overrides):
    """Each job cold and batched, then each one again warm, one after another."""
    config = EngineConfig(model=str(model_dir), device=device, dtype="float32", block_size=16, seam_width=4,
                          cpu_cache_bytes=64 << 20, gpu_memory_utilization=GPU_SHARE, max_num_seqs=8,
                          **{"segment_host_bytes": 0, **overrides})

    async def main():
        async with AsyncEngine(config) as engine:
            firsts = await asyncio.gather(*(collect(engine, p, s) for p, s in jobs))  # cold, batched
            seconds = [await collect(engine, p, s) for p, s in jobs]  # warm
            return firsts, seconds
    return asyncio.run(main())


def logprobs(out) -> list[float]:
    return [x.logprob for x in out.logprobs[0]]


def assert_gpu_engine_matches_cpu_engine(model_dir, mode: str) -> None:
    jobs = [(prompt(*DOCS), greedy(8, logprobs=0)), (prompt(DOCS[2], DOCS[0]), greedy(5, logprobs=0)),
            ("hello world, the quick brown fox", greedy(6, logprobs=0))]
    cpu = engine_run(model_dir, "cpu", jobs, cache_mode=mode)
    gpu = engine_run(model_dir, "cuda", jobs, cache_mode=mode)
    for cpu_outs, gpu_outs in zip(cpu, gpu):
        for c, g in zip(cpu_outs, gpu_outs):
            assert logprobs(g) == pytest.approx(logprobs(c), abs=2e-3)
            assert g.tokens == c.tokens
    # cold round: whether the second request finds the first one's segments already stored depends on
    # step timing (the H200 stored them first); the warm round is served alike on both devices
    by_kind = [[o.metrics.cached_tokens_by_kind for o in run[1]] for run in (gpu, cpu)]
    assert by_kind[0] == by_kind[1]
