"""Position-independent caching through the engine, on CPU, against full recompute (`none`)."""
from __future__ import annotations

import pytest
import torch
from conftest import make_model_dir
from engine_util import greedy
from pic_util import (DOCS, QUERY, SEP, SYSTEM, assert_composed_first_state_exact,
                      assert_reordered_hit_and_other_salts_miss, assert_scattered_first_pages_exact,
                      assert_wide_seam_equals_none, pic_config, prompt, rel, run, run_with_store_stats,
                      state_after_prefill)

from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.pieces import TAIL_WALK_MAX
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.setup import resolve_segment_state_dtype


def test_cold_then_warm_hypic_gives_the_same_tokens_and_counts_interiors(tiny_model_dir):
    p = prompt(*DOCS)
    cold, = run(pic_config(tiny_model_dir), [(p, greedy(6, logprobs=0), {})])
    # the documents warmed by another question (the same prompt again would be a prefix-cache hit)
    warm_up = prompt(*reversed(DOCS), query="?")
    _, warm = run(pic_config(tiny_model_dir), [(warm_up, greedy(1), {}), (p, greedy(6, logprobs=0), {})])
    assert warm.tokens == cold.tokens
    got = [lp.logprob for lp in warm.logprobs[0]]
    assert got == pytest.approx([lp.logprob for lp in cold.logprobs[0]], abs=1e-5)
    assert cold.metrics.cached_tokens_by_kind.get("pic", 0) == 0
    engine_tokens = SegmentedPrompt.build(_tokenizer(tiny_model_dir), p, separator=SEP)
    interiors = sum(len(s) - 8 for s in engine_tokens.segments[1:-1])  # [w, L - w) with w = 4 >= k - 1
    assert warm.metrics.cached_tokens_by_kind["pic"] == interiors
    assert warm.metrics.cached_tokens == interiors + warm.metrics.cached_tokens_by_kind.get("prefix", 0)


def test_long_query_after_the_last_segment_matches_a_short_walk(slow_decay_model_dir):
    """A query longer than TAIL_WALK_MAX continues from the composed state through the chunked
    kernel in the same step; the first linear layer's state must still equal full recompute."""
    from hypic.engine.pic.pieces import TAIL_WALK_MAX
    long_query = "the quick brown fox jumps over the lazy dog. " * 9
    p = prompt(DOCS[2], query=long_query)
    assert len(_tokenizer(slow_decay_model_dir).encode(long_query)) > TAIL_WALK_MAX
    one_step = {"max_num_batched_tokens": 1024}  # the whole assembly chunk, tail included, in one step
    full = state_after_prefill(pic_config(slow_decay_model_dir, cache_mode="none", **one_step), p, 0, warm_first=False)
    composed = state_after_prefill(pic_config(slow_decay_model_dir, **one_step), p, 0, warm_first=True)
    assert rel(composed["ssm"], full["ssm"]) <= 1e-4


def test_seam_wide_enough_to_recompute_everything_equals_none(tiny_model_dir):
    assert_wide_seam_equals_none(tiny_model_dir)


def test_reordered_segments_hit_and_other_salts_never_do(tiny_model_dir):
    assert_reordered_hit_and_other_salts_miss(tiny_model_dir)


def test_warm_up_and_side_effect_caching_give_identical_results(tiny_model_dir):
    # documents in another order than the warm-up's: its end checkpoint must not serve them instead
    target = prompt(DOCS[1], DOCS[0], query="the lazy dog")
    warmup = SEP.join([SYSTEM, DOCS[0], DOCS[1], ""])  # empty query: only fills the cache
    by_warmup = run(pic_config(tiny_model_dir), [(warmup, greedy(3), {}), (target, greedy(5, logprobs=0), {})])
    side = prompt(DOCS[1], DOCS[0], query="something else")
    by_side_effect = run(pic_config(tiny_model_dir), [(side, greedy(3), {}), (target, greedy(5, logprobs=0), {})])
    assert by_warmup[0].tokens == []
    a, b = by_warmup[1], by_side_effect[1]
    assert a.tokens == b.tokens
    assert [x.logprob for x in a.logprobs[0]] == pytest.approx([x.logprob for x in b.logprobs[0]], abs=1e-6)
    assert a.metrics.cached_tokens_by_kind["pic"] == b.metrics.cached_tokens_by_kind["pic"] > 0


def test_warm_request_prefills_in_one_step_and_keeps_the_last_checkpoint(slow_decay_model_dir):
    """The assembly chunk runs through the prompt's last token and keeps the state one token
    before it (the prefix checkpoint there) from inside the walk; an identical repeat resumes from
    that checkpoint, past every cached piece, and must give the same tokens and logprobs."""
    engine = LLMEngine(pic_config(slow_decay_model_dir))
    p = SegmentedPrompt.build(engine.tokenizer, prompt(*DOCS), separator=SEP)
    warm_up = prompt(*reversed(DOCS), query="?")  # another order: the prefix cache cannot serve p
    cold = _steps_and_output(engine, SegmentedPrompt.build(engine.tokenizer, warm_up, separator=SEP))
    warm, repeat = (_steps_and_output(engine, p) for _ in range(2))
    assert cold["first_token_step"] > 1 and warm["first_token_step"] == 1
    # the short system prompt is walked in the assembly step, not cut off as a step (and checkpoint) of its own
    assert warm["cached"].keys() == {"pic"} and warm["cached"]["pic"] > 0
    assert repeat["first_token_step"] == 1 and repeat["cached"] == {"prefix": len(p.token_ids) - 1}
    assert repeat["tokens"] == warm["tokens"] and len(warm["tokens"]) == 4
    assert repeat["logprobs"] == pytest.approx(warm["logprobs"], abs=1e-5)
    assert engine.store.stats().pinned == 0


def test_a_long_system_prompt_is_checkpointed_and_hit_by_the_next_prompt(slow_decay_model_dir):
    """A first segment longer than the walk takes runs as a step of its own and keeps its state:
    the next prompt with the same system prompt (another document) starts from it."""
    engine = LLMEngine(pic_config(slow_decay_model_dir))
    system = SYSTEM * 7
    first = SegmentedPrompt.build(engine.tokenizer, SEP.join([system, DOCS[0], QUERY]), separator=SEP)
    assert len(first.segments[0]) > TAIL_WALK_MAX
    _steps_and_output(engine, first)
    second = SegmentedPrompt.build(engine.tokenizer, SEP.join([system, DOCS[1], "?"]), separator=SEP)
    assert _steps_and_output(engine, second)["cached"]["prefix"] == len(first.segments[0])


def test_next_turn_resumes_after_its_documents(slow_decay_model_dir):
    """Turn 2 = turn 1's prompt + its answer + a new message: it resumes from turn 1's end-of-request
    checkpoint, past the cached documents (their pins released, their tokens counted as a prefix
    hit), and answers as an engine that composes the documents afresh."""
    engine = LLMEngine(pic_config(slow_decay_model_dir))
    first = SegmentedPrompt.build(engine.tokenizer, prompt(DOCS[0], DOCS[1]), separator=SEP)
    answer = _steps_and_output(engine, first)["tokens"]
    follow_up = engine.tokenizer.encode(" and the lazy dog?")
    segments = first.segments
    second = SegmentedPrompt((*segments[:-1], (*segments[-1], *answer, *follow_up)))
    resumed = _steps_and_output(engine, second)
    fresh = _steps_and_output(LLMEngine(pic_config(slow_decay_model_dir)), second)
    assert resumed["cached"]["prefix"] >= len(first.token_ids) and resumed["cached"].get("pic", 0) == 0
    assert fresh["cached"].get("prefix", 0) < len(first.token_ids)  # cold documents, composed
    assert resumed["tokens"] == fresh["tokens"]
    assert resumed["logprobs"] == pytest.approx(fresh["logprobs"], abs=1e-4)
    assert engine.store.stats().pinned == 0


def _steps_and_output(engine: LLMEngine, p: SegmentedPrompt) -> dict:
    rid = engine.add_request(p, greedy(4, logprobs=0))
    result = {"first_token_step": None, "tokens": [], "logprobs": [], "cached": {}}
    steps = 0
    while engine.has_work():
        steps += 1
        for out in engine.step():
            for delta in out.deltas if out.request_id == rid else ():
                if delta.token_ids and result["first_token_step"] is None:
                    result["first_token_step"] = steps
                result["tokens"] += delta.token_ids
                result["logprobs"] += [lp.logprob for lp in delta.logprobs]
            result["cached"] = dict(out.metrics.cached_tokens_by_kind)
    return result


def test_tiny_pool_evicts_and_stays_correct(tiny_model_dir):
    jobs = [(prompt(d), greedy(3, logprobs=0), {}) for d in DOCS * 2]
    roomy, stats = run_with_store_stats(pic_config(tiny_model_dir), jobs)
    assert stats.evictions == 0 and stats.entries == 3
    room_for_one = stats.bytes // 2  # the three entries are of similar size
    tight, stats = run_with_store_stats(pic_config(tiny_model_dir, segment_pool_bytes=room_for_one), jobs)
    assert stats.evictions >= 4 and stats.entries == 1
    assert [o.tokens for o in tight] == [o.tokens for o in roomy]
    assert [o.logprobs[0][-1].logprob for o in tight] == pytest.approx(
        [o.logprobs[0][-1].logprob for o in roomy], abs=1e-6)


def test_naive_mode_runs_and_differs_from_hypic(tiny_model_dir):
    p = prompt(*DOCS)
    jobs = [(prompt(*reversed(DOCS), query="?"), greedy(1), {}), (p, greedy(4, logprobs=0), {})]  # warm-up, p
    naive = run(pic_config(tiny_model_dir, cache_mode="naive"), jobs)[1]
    hypic = run(pic_config(tiny_model_dir), jobs)[1]
    assert naive.metrics.cached_tokens_by_kind["pic"] > hypic.metrics.cached_tokens_by_kind["pic"]
    assert [x.logprob for x in naive.logprobs[0]] != pytest.approx([x.logprob for x in hypic.logprobs[0]], abs=1e-3)


# -- exactness where the algebra is exact --------------------------------------------------------

def _tokenizer(model_dir):
    from hypic.engine.text.tokenizer import Tokenizer
    return Tokenizer.from_dir(model_dir)


def test_composed_state_at_the_first_linear_layer_equals_full_recompute(slow_decay_model_dir):
    """Exact at layer 0 (its inputs are embeddings); needs the conv tail spliced after each interior."""
    assert_composed_first_state_exact(slow_decay_model_dir)


@pytest.fixture(scope="module")
def attention_first_model(tmp_path_factory):
    """Layer 0 is full attention: its K/V depend on embeddings only, so cached interiors must land
    in the pages exactly as full recompute writes them (rotated at their global positions)."""
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    return make_model_dir(tmp_path_factory.mktemp("attn_first"), slow_decay=True, layer_types=types,
                          num_hidden_layers=4)


def test_scattered_interior_kv_equals_full_recompute(attention_first_model):
    assert_scattered_first_pages_exact(attention_first_model)


def test_cached_tuples_default_to_the_models_precision(tiny_model_dir):
    """None stores T and S0 as the model computes: float32 stays exact, half precision halves the pool."""
    assert LLMEngine(pic_config(tiny_model_dir)).store.layout.state_dtype == torch.float32
    assert LLMEngine(pic_config(tiny_model_dir, segment_state_dtype="bfloat16")).store.layout.state_dtype \
        == torch.bfloat16
    expected = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.bfloat16}
    assert {dtype: resolve_segment_state_dtype(None, dtype) for dtype in expected} == expected
    assert resolve_segment_state_dtype("float32", torch.bfloat16) == torch.float32
