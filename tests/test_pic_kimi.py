"""Position-independent caching of Kimi-Linear (kda family + NoPE MLA latents) through the engine, on
CPU, against full recompute (`none`): the Qwen / Mamba2 PIC tests' claims on a slow-decay tiny
checkpoint whose layer 0 is KDA (its dense T composed through the walk kernel's kda path), and one
whose layer 0 is MLA (cached latents scattered as they are)."""
from __future__ import annotations

import pytest

import kimi_models
from hypic.kernels import pic_layer
from test_pic_engine import DOCS, _rel, _state_after_prefill, pic_config, prompt, run, run_with_store_stats
from engine_util import greedy
from test_models_kimi import MLA_FIRST

NAIVE_MIN_ERROR = 0.1  # naive's relative error of the first KDA layer's state


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory):
    return kimi_models.make_model_dir(tmp_path_factory.mktemp("kimi_pic"), slow_decay=True)


def first_kda_state(model_dir, mode: str) -> dict:
    return _state_after_prefill(pic_config(model_dir, cache_mode=mode), prompt(*DOCS), 0, warm_first=mode != "none")


def test_composed_state_at_the_first_kda_layer_equals_full_recompute(kimi_dir) -> None:
    full, composed = first_kda_state(kimi_dir, "none"), first_kda_state(kimi_dir, "hypic")
    assert _rel(composed["ssm"], full["ssm"]) <= 1e-4
    assert _rel(composed["conv"], full["conv"]) <= 1e-5
    assert _rel(first_kda_state(kimi_dir, "naive")["ssm"], full["ssm"]) > NAIVE_MIN_ERROR


def test_the_conv_tails_are_what_make_it_exact(kimi_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seam tokens read the interior's last W-1 pre-conv inputs of q, k and v: zeroed, the state is off."""
    full = first_kda_state(kimi_dir, "none")
    spliced = pic_layer.spliced_conv
    monkeypatch.setattr(pic_layer, "spliced_conv", lambda x, tails, *rest: spliced(x, tails * 0, *rest))
    assert _rel(first_kda_state(kimi_dir, "hypic")["ssm"], full["ssm"]) > 1e-2


def test_seam_wide_enough_to_recompute_everything_equals_none(kimi_dir) -> None:
    p = prompt(*DOCS)
    full, = run(pic_config(kimi_dir, cache_mode="none"), [(p, greedy(6, logprobs=0), {})])
    _, wide = run(pic_config(kimi_dir, seam_width=10_000), [(p, greedy(6, logprobs=0), {})] * 2)
    assert wide.tokens == full.tokens
    assert [x.logprob for x in wide.logprobs[0]] == pytest.approx([x.logprob for x in full.logprobs[0]], abs=1e-5)


def test_reordered_segments_hit_other_salts_never_do_and_a_tiny_pool_evicts(kimi_dir) -> None:
    first, reordered, other_salt = run(pic_config(kimi_dir), [
        (prompt(DOCS[0], DOCS[1]), greedy(2), {}), (prompt(DOCS[1], DOCS[0]), greedy(2), {}),
        (prompt(DOCS[1], DOCS[0]), greedy(2), {"cache_salt": "tenant-b"})])
    assert first.metrics.cached_tokens_by_kind.get("pic", 0) == 0
    assert reordered.metrics.cached_tokens_by_kind["pic"] > 0
    assert other_salt.metrics.cached_tokens_by_kind.get("pic", 0) == 0
    jobs = [(prompt(d), greedy(3, logprobs=0), {}) for d in DOCS * 2]
    roomy, stats = run_with_store_stats(pic_config(kimi_dir), jobs)
    tight, stats = run_with_store_stats(pic_config(kimi_dir, segment_pool_bytes=stats.bytes // 2), jobs)
    assert stats.evictions >= 4 and stats.pinned == 0
    assert [o.tokens for o in tight] == [o.tokens for o in roomy]


def test_scattered_interior_latents_equal_full_recompute(tmp_path) -> None:
    """Layer 0 is MLA: cached position-free latents land in the pages exactly as full recompute writes them."""
    model_dir = kimi_models.make_model_dir(tmp_path, slow_decay=True, linear_attn_config=MLA_FIRST)
    p = prompt(*DOCS)
    full = _state_after_prefill(pic_config(model_dir, cache_mode="none"), p, 0, warm_first=False)
    warm = _state_after_prefill(pic_config(model_dir), p, 0, warm_first=True)
    assert _rel(warm["k"], full["k"]) <= 1e-5 and _rel(warm["v"], full["v"]) <= 1e-5


def test_blocks_slots_and_pins_return(kimi_dir) -> None:
    import asyncio

    from engine_util import collect
    from hypic import AsyncEngine

    async def main():
        async with AsyncEngine(pic_config(kimi_dir)) as engine:
            await asyncio.gather(*(collect(engine, prompt(*order), greedy(3)) for order in (DOCS, DOCS[::-1])))
            return engine.core.stats()
    s = asyncio.run(main())
    assert s.kv_blocks_total - s.kv_blocks_free == s.prefix_cache.blocks_held
    assert s.state_slots_total - s.state_slots_free == s.prefix_cache.slots_held
    assert s.segment_pool.pinned == 0 and s.segment_pool.entries == 3


def test_a_latent_layout_stores_each_row_once_and_ships_it_once() -> None:
    """kv_tensors 1 (MLA): the KV block holds one latent row a token and layer, the stored tuple
    has no V, and the wire carries exactly the K tensors its specs announce."""
    import torch

    from hypic.cache.model_caches import LinearShape
    from hypic.cache.prefix_cache import token_bytes
    from hypic.cache.segment_store import SegmentKey, SegmentLayout, SegmentStore, SegmentTuple
    from hypic.dist.segment_wire import tuple_from, tuple_meta, tuple_specs, tuple_tensors
    from hypic.kernels.linear_families import get_family

    shapes = (LinearShape(get_family("kda"), 2, 8, 8, 48, 4),) * 2
    latent, symmetric = (SegmentLayout(shapes, 3, 1, 24, torch.float32, torch.float32, kv) for kv in (1, 2))
    assert symmetric.block_bytes(64)[3] == 2 * latent.block_bytes(64)[3] == 2 * 64 * 3 * 24 * 4
    store, g = SegmentStore(latent, 1 << 20, "cpu"), torch.Generator().manual_seed(2)
    parts = [[torch.randn(*shape, generator=g) for _ in range(n)] for shape, n in (
        (latent.t_shape(0), 2), (latent.s0_shape(0), 2), (latent.conv_shape(0), 2), ((10, 1, 24), 3))]
    key = SegmentKey.of("fp", 8, None, token_bytes([4, 5]))
    assert store.put(key, SegmentTuple((4, 14), *parts, []))
    stored = store.get(key).views()
    assert stored.V == [] and all(torch.equal(a, b) for a, b in zip(stored.K, parts[3]))
    flat = tuple_tensors(stored)
    assert [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in flat] == [
        (s.dtype, s.shape) for s in tuple_specs(latent, 10)]
    back = tuple_from([t.contiguous() for t in flat], tuple_meta(stored))
    assert back.V == [] and all(torch.equal(a, b) for a, b in zip(back.K, parts[3]))
