"""Abort, preemption and memory accounting: every page and slot comes back."""
from __future__ import annotations

import asyncio

import pytest
from engine_util import cpu_config, greedy, hf_greedy, run_engine

from hypic import AsyncEngine
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt


def ids(n: int, seed: int) -> list[int]:
    import torch
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_all_free(engine: LLMEngine) -> None:
    engine.prefix.clear()
    assert engine.blocks.num_free == engine.plan.num_blocks
    assert engine.slots.num_free == engine.plan.num_slots
    assert not engine.scheduler.running and not engine.scheduler.waiting


def add(engine: LLMEngine, tokens: list[int], params) -> str:
    prompt = SegmentedPrompt.build(engine.tokenizer, tokens, separator="<|segment|>")
    return engine.add_request(prompt, params)


def test_abort_mid_prefill_and_mid_decode_frees_everything(tiny_model_dir):
    engine = LLMEngine(cpu_config(tiny_model_dir, max_num_batched_tokens=8))
    prefilling = add(engine, ids(40, 0), greedy(5))
    decoding = add(engine, ids(6, 1), greedy(50))
    engine.step()
    assert engine.requests[prefilling].sequences[0].num_computed < 40
    aborted = engine.abort(prefilling)
    assert aborted.finished and aborted.deltas[0].finish_reason == "abort"
    while not engine.requests[decoding].sequences[0].output_ids:
        engine.step()
    engine.step()
    assert engine.abort(decoding).deltas[0].finish_reason == "abort"
    assert engine.abort("no-such-request") is None
    assert_all_free(engine)


def test_preemption_under_a_tiny_budget_keeps_outputs_right(tiny_model_dir):
    # Room for ~2 sequences' pages: 4 concurrent requests must preempt and recompute.
    config = cpu_config(tiny_model_dir, cpu_cache_bytes=60_000, segment_pool_bytes=0, max_model_len=64,
                        max_num_seqs=4)
    engine = LLMEngine(config)
    prompts = [ids(20, s) for s in range(4)]
    request_ids = [add(engine, p, greedy(12)) for p in prompts]
    outputs: dict[str, list[int]] = {r: [] for r in request_ids}
    preempted = 0
    while engine.has_work():
        running_before = len(engine.scheduler.running)
        for out in engine.step():
            outputs[out.request_id].extend(t for d in out.deltas for t in d.token_ids)
        preempted += running_before > len(engine.scheduler.running) and engine.scheduler.waiting.__len__() > 0
    assert preempted > 0, "the budget was meant to force preemption"
    vocab = engine.tokenizer.vocab_size
    for rid, prompt in zip(request_ids, prompts):
        assert outputs[rid] == hf_greedy(tiny_model_dir, prompt, 12, vocab)[0]
    assert_all_free(engine)


def test_cancelling_the_consumer_aborts_and_frees(tiny_model_dir):
    async def main() -> LLMEngine:
        async with AsyncEngine(cpu_config(tiny_model_dir)) as engine:
            async for out in engine.generate(ids(10, 3), greedy(200)):
                if out.deltas and out.deltas[0].token_ids:
                    break
            [again] = [o async for o in _collect_one(engine)]
            assert again.finished
            return engine.core
    core = asyncio.run(main())
    assert core.counters["aborted"] == 1
    assert_all_free(core)


async def _collect_one(engine):
    # A request after the abort proves the engine still serves; its last output is yielded.
    last = None
    async for out in engine.generate(ids(5, 4), greedy(2)):
        last = out
    yield last


def test_n_completions_share_the_prefill(tiny_model_dir):
    from hypic import SamplingParams
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    [out] = run_engine(cpu_config(tiny_model_dir), [(ids(12, 5), params)])
    [again] = run_engine(cpu_config(tiny_model_dir), [(ids(12, 5), params)])
    assert sorted(out.token_ids) == [0, 1, 2] and all(len(t) == 6 for t in out.token_ids.values())
    assert out.token_ids == again.token_ids  # seeded: reproducible
    assert len({tuple(t) for t in out.token_ids.values()}) > 1


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(n=0)])
def test_bad_sampling_values_raise_typed_errors(bad):
    from hypic import InvalidRequestError, SamplingParams
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_prompt_longer_than_context_is_rejected(tiny_model_dir):
    from hypic import PromptTooLongError
    with pytest.raises(PromptTooLongError) as info:
        run_engine(cpu_config(tiny_model_dir, max_model_len=32), [(ids(40, 0), greedy(1))])
    assert info.value.prompt_tokens == 40 and info.value.max_model_len == 32


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_a_prompt_id_without_an_embedding_row_is_refused_and_the_engine_serves_on(tiny_model_dir, bad):
    """Through the Python API (no server to check ids), an id outside the vocabulary is a typed error
    naming the range, not an IndexError in the forward; the next request is served."""
    from hypic import InvalidRequestError
    engine = LLMEngine(cpu_config(tiny_model_dir))
    bad_id = engine.served_vocab_size if bad == "vocab" else bad
    with pytest.raises(InvalidRequestError, match=f"prompt token id {bad_id} has no embedding row: ids run from 0 to "
                       f"{engine.served_vocab_size - 1}"):
        engine.add_request(SegmentedPrompt(((5, bad_id, 7),)), greedy(2), request_id="bad")
    engine.add_request(SegmentedPrompt(((5, 6, 7),)), greedy(2), request_id="good")
    while engine.has_work():
        engine.step()
    assert not engine.requests
