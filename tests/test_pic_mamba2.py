"""Position-independent caching of the Mamba2 hybrids (scalar family) through the engine, on CPU,
against full recompute (`none`): the Qwen PIC tests' claims on a slow-decay tiny Nemotron-H
(block 0 a Mamba2 mixer), plus attention-first Bamba (RoPE) and Nemotron-H (NoPE)."""
from __future__ import annotations

import pytest

import mamba2_models
from engine_util import greedy
from pic_util import (DOCS, assert_blocks_slots_and_pins_return, assert_composed_first_state_exact,
                      assert_reordered_hit_and_other_salts_miss, assert_scattered_first_pages_exact,
                      assert_wide_seam_equals_none, first_layer_state, pic_config, prompt, rel, run_with_store_stats,
                      state_error_without_conv_tails)

# naive's relative error of the first Mamba2 layer's state (measured 0.34; hypic's 1.2e-7)
NAIVE_MIN_ERROR = 0.1


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory: pytest.TempPathFactory):
    return mamba2_models.make_model_dir(tmp_path_factory.mktemp("nemotron_pic"), "nemotron_h", slow_decay=True)


def test_composed_state_at_the_first_mamba2_layer_equals_full_recompute(nemotron_dir) -> None:
    full = assert_composed_first_state_exact(nemotron_dir)
    assert rel(first_layer_state(nemotron_dir, "naive")["ssm"], full["ssm"]) > NAIVE_MIN_ERROR


def test_the_conv_tail_is_what_makes_it_exact(nemotron_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seam tokens read the interior's last W-1 pre-conv inputs: zeroed, the state is off."""
    assert state_error_without_conv_tails(nemotron_dir, monkeypatch) > 1e-2  # measured 0.069


def test_seam_wide_enough_to_recompute_everything_equals_none(nemotron_dir) -> None:
    assert_wide_seam_equals_none(nemotron_dir)


def test_reordered_segments_hit_and_other_salts_never_do(nemotron_dir) -> None:
    assert_reordered_hit_and_other_salts_miss(nemotron_dir)


def test_tiny_pool_evicts_stays_correct_and_everything_returns(nemotron_dir) -> None:
    jobs = [(prompt(d), greedy(3, logprobs=0), {}) for d in DOCS * 2]
    roomy, stats = run_with_store_stats(pic_config(nemotron_dir), jobs)
    assert stats.evictions == 0 and stats.entries == 3
    tight, stats = run_with_store_stats(pic_config(nemotron_dir, segment_pool_bytes=stats.bytes // 2), jobs)
    assert stats.evictions >= 4 and stats.entries == 1 and stats.pinned == 0
    assert [o.tokens for o in tight] == [o.tokens for o in roomy]
    assert [o.logprobs[0][-1].logprob for o in tight] == pytest.approx(
        [o.logprobs[0][-1].logprob for o in roomy], abs=1e-6)


def test_blocks_slots_and_pins_return(nemotron_dir) -> None:
    assert_blocks_slots_and_pins_return(nemotron_dir)


@pytest.mark.parametrize("kind,overrides", [("bamba", {"attn_layer_indices": [0]}),
                                            ("nemotron_h", {"hybrid_override_pattern": "*M-M"})])
def test_scattered_interior_kv_equals_full_recompute(kind: str, overrides: dict, tmp_path) -> None:
    """Block 0 is attention (RoPE on half the head / none): cached pre-RoPE interiors must land in
    the pages exactly as full recompute writes them."""
    assert_scattered_first_pages_exact(mamba2_models.make_model_dir(tmp_path, kind, slow_decay=True, **overrides))
