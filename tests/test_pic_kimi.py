"""Position-independent caching of Kimi-Linear (kda family + NoPE MLA latents) through the engine, on
CPU, against full recompute (`none`): the Qwen / Mamba2 PIC tests' claims on a slow-decay tiny
checkpoint whose layer 0 is KDA (its dense T composed through the walk kernel's kda path), and one
whose layer 0 is MLA (cached latents scattered as they are)."""
from __future__ import annotations

import pytest

import kimi_models
from hypic.engine.llm_engine import LLMEngine
from engine_util import greedy
from pic_util import (DOCS, assert_blocks_slots_and_pins_return, assert_composed_first_state_exact,
                      assert_reordered_hit_and_other_salts_miss, assert_scattered_first_pages_exact,
                      assert_wide_seam_equals_none, first_layer_state, pic_config, prompt, rel, run_with_store_stats,
                      state_error_without_conv_tails)
from test_models_kimi import MLA_FIRST
from test_pic_assembly_graphs import (assert_grouped_steps_give_the_eager_tokens_and_logprobs,
                                      assert_padded_steps_give_the_eager_tokens_and_logprobs)

NAIVE_MIN_ERROR = 0.1  # naive's relative error of the first KDA layer's state


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory):
    return kimi_models.make_model_dir(tmp_path_factory.mktemp("kimi_pic"), slow_decay=True)


def test_composed_state_at_the_first_kda_layer_equals_full_recompute(kimi_dir) -> None:
    full = assert_composed_first_state_exact(kimi_dir)
    assert rel(first_layer_state(kimi_dir, "naive")["ssm"], full["ssm"]) > NAIVE_MIN_ERROR


def test_the_conv_tails_are_what_make_it_exact(kimi_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seam tokens read the interior's last W-1 pre-conv inputs of q, k and v: zeroed, the state is off."""
    assert state_error_without_conv_tails(kimi_dir, monkeypatch) > 1e-2


def test_padded_assembly_step_as_captured_gives_the_eager_tokens_and_logprobs(kimi_dir) -> None:
    """The warm step as AssemblyGraphs captures it (padded; in_graph: MLA in one latent pass), run eagerly."""
    assert_padded_steps_give_the_eager_tokens_and_logprobs(kimi_dir)


def test_assemblies_of_one_step_share_padded_steps_as_captured(kimi_dir) -> None:
    """MLA's latent pass over several requests, their dummies and the padding in one padded step."""
    assert_grouped_steps_give_the_eager_tokens_and_logprobs(kimi_dir)


def test_a_warm_chunk_longer_than_expand_from_attends_latent_as_captured(kimi_dir) -> None:
    """A long question makes the warm chunk (seams and question, its positions jumping over the cached
    interiors) longer than MLA's expand_from: eager, it must still attend in the latent space (the
    expanded form masks a chunk as its sequence's last tokens), as its padded step does."""
    sizes_used = assert_padded_steps_give_the_eager_tokens_and_logprobs(kimi_dir, query=DOCS[1],
                                                                        sizes=tuple(range(120, 260, 8)))
    model = LLMEngine(pic_config(kimi_dir)).runner.model
    expand_from = model.layers[model.config.full_layers[0]].mixer.expand_from
    assert min(sizes_used) > expand_from + 8  # the chunks themselves outnumber it


def test_seam_wide_enough_to_recompute_everything_equals_none(kimi_dir) -> None:
    assert_wide_seam_equals_none(kimi_dir)


def test_reordered_segments_hit_other_salts_never_do_and_a_tiny_pool_evicts(kimi_dir) -> None:
    assert_reordered_hit_and_other_salts_miss(kimi_dir)
    jobs = [(prompt(d), greedy(3, logprobs=0), {}) for d in DOCS * 2]
    roomy, stats = run_with_store_stats(pic_config(kimi_dir), jobs)
    tight, stats = run_with_store_stats(pic_config(kimi_dir, segment_pool_bytes=stats.bytes // 2), jobs)
    assert stats.evictions >= 4 and stats.pinned == 0
    assert [o.tokens for o in tight] == [o.tokens for o in roomy]


def test_scattered_interior_latents_equal_full_recompute(tmp_path) -> None:
    """Layer 0 is MLA: cached position-free latents land in the pages exactly as full recompute writes them."""
    assert_scattered_first_pages_exact(
        kimi_models.make_model_dir(tmp_path, slow_decay=True, linear_attn_config=MLA_FIRST))


def test_blocks_slots_and_pins_return(kimi_dir) -> None:
    assert_blocks_slots_and_pins_return(kimi_dir)


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
