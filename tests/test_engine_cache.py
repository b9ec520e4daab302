"""Prefix cache through the engine: hits give the cold run's tokens and report cached tokens."""
from __future__ import annotations

import asyncio

import pytest
from engine_util import collect, cpu_config, greedy

from hypic import AsyncEngine, SamplingParams
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.text.tokenizer import Tokenizer

SEP = "<|segment|>"


def run_sequentially(config, jobs):
    """One request after another on one engine (so later ones can hit earlier checkpoints)."""
    async def main():
        async with AsyncEngine(config) as engine:
            return [await collect(engine, p, s, **kw) for p, s, kw in jobs]
    return asyncio.run(main())


def test_repeated_prompt_hits_and_matches_cold(tiny_model_dir):
    prompt = "the quick brown fox jumps over the lazy dog. hello world, " * 3
    cold, warm = run_sequentially(cpu_config(tiny_model_dir), [(prompt, greedy(5), {})] * 2)
    assert cold.metrics.cached_tokens == 0
    assert warm.tokens == cold.tokens
    n = warm.metrics.prompt_tokens
    assert warm.metrics.cached_tokens == n - 1  # everything but the last token, which gives the logits
    off = run_sequentially(cpu_config(tiny_model_dir, cache_mode="none"), [(prompt, greedy(5), {})] * 2)
    assert off[1].metrics.cached_tokens == 0 and off[1].tokens == cold.tokens


def test_second_chat_turn_reuses_first_turn(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    turn1 = tok.encode("hello world, the quick brown fox")
    config = cpu_config(tiny_model_dir)
    first, = run_sequentially(config, [(turn1, greedy(4), {})])
    turn2 = turn1 + first.tokens + tok.encode(" jumps over the lazy dog.")
    fresh = run_sequentially(config, [(turn2, greedy(4), {})])[0]
    warm = run_sequentially(config, [(turn1, greedy(4), {}), (turn2, greedy(4), {})])[1]
    assert warm.tokens == fresh.tokens
    assert warm.metrics.cached_tokens == len(turn1) + len(first.tokens) - 1


def test_shared_system_prompt_segment_hits(tiny_model_dir):
    system = "Position-independent caching reuses documents at any position in the prompt."
    a, b = f"{system}{SEP} hello world", f"{system}{SEP} the lazy dog"
    tok = Tokenizer.from_dir(tiny_model_dir)
    config = cpu_config(tiny_model_dir)
    cold_b = run_sequentially(config, [(b, greedy(4), {})])[0]
    _, warm_b = run_sequentially(config, [(a, greedy(4), {}), (b, greedy(4), {})])
    assert warm_b.tokens == cold_b.tokens
    assert warm_b.metrics.cached_tokens == len(tok.encode(system))


def test_cache_salt_isolates_tenants(tiny_model_dir):
    prompt = "hello world, the quick brown fox jumps over the lazy dog."
    jobs = [(prompt, greedy(3), {"cache_salt": "a"}), (prompt, greedy(3), {"cache_salt": "b"}),
            (prompt, greedy(3), {"cache_salt": "a"})]
    first, other, same = run_sequentially(cpu_config(tiny_model_dir), jobs)
    assert other.metrics.cached_tokens == 0 and same.metrics.cached_tokens > 0
    assert first.tokens == other.tokens == same.tokens


def test_max_tokens_zero_fills_the_cache(tiny_model_dir):
    prompt = "hello world, the quick brown fox jumps over the lazy dog."
    warmup, real = run_sequentially(cpu_config(tiny_model_dir),
                                    [(prompt, SamplingParams(max_tokens=0), {}), (prompt, greedy(3), {})])
    assert warmup.tokens == [] and warmup.finish_reason[0] == "length"
    assert real.metrics.cached_tokens > 0


def test_prompt_resumed_at_its_last_token_runs_with_the_decodes(tiny_model_dir):
    """A repeat hits everything but its last token: that one-token chunk is a decode step, so it
    joins the decode rows (the decode graphs on a GPU) beside a request already decoding, and gives
    the cold run's tokens and logprobs."""
    engine = LLMEngine(cpu_config(tiny_model_dir))
    prompt = SegmentedPrompt((tuple(engine.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)),))
    cold = _run(engine, prompt)
    engine.add_request(SegmentedPrompt((tuple(engine.tokenizer.encode("hello world")),)), greedy(8))
    engine.step()  # its prefill: it decodes from the next step on
    shapes = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch, *rest, **kw: shapes.append((batch.num_decodes, len(batch.chunks))) or execute(
        batch, *rest, **kw)
    repeat = _run(engine, prompt)
    assert shapes[0] == (2, 2)  # the repeat's one prefill step: both rows run as decodes
    assert repeat["tokens"] == cold["tokens"]
    assert repeat["logprobs"] == pytest.approx(cold["logprobs"], abs=1e-5)


def _run(engine: LLMEngine, prompt: SegmentedPrompt) -> dict:
    rid = engine.add_request(prompt, greedy(4, logprobs=0))
    result: dict = {"tokens": [], "logprobs": []}
    while rid in engine.requests:
        for out in engine.step():
            for delta in out.deltas if out.request_id == rid else ():
                result["tokens"] += delta.token_ids
                result["logprobs"] += [lp.logprob for lp in delta.logprobs]
    return result
