"""The long-prefill cap (issue 26 item 2): beside decodes or warm work, a cold segment job or a long
uncached prefill costs at most `long_prefill_token_threshold` a step, counted n·(1 + context / L)
with L fitted from the engine's own steps; alone it takes the whole step budget; warm requests go
before it; the outputs are those of an uncapped run. Steps are counted, never timed."""
from __future__ import annotations

import random

import pytest
import torch

from engine_util import GPU_SHARE, greedy
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.scheduler import ScheduledBatch
from hypic.engine.prefill_cost import CONTEXT_RANGE, REFIT_EVERY, UNMEASURED_CONTEXT, PrefillCost, StepWork
from hypic.engine.sequence import Sequence
from pic_util import DOCS, SEP, SYSTEM, pic_config
from test_pic_chunked_capture import LONG_DOC, _accounting

CAP = 16


@pytest.mark.parametrize("context", [300.0, 16384.0, 1e6])
def test_tokens_within_is_the_most_tokens_whose_cost_fits(context):
    cost = PrefillCost(context)
    for start in (0, 1, 999, 15_000):
        for budget in (0.5, 1, 16, 64.3, 512):
            fits = [n for n in range(0, 600) if cost.cost(start, n) <= budget]
            assert cost.tokens_within(start, budget) == max(fits)


def _synthetic_steps(per_token: float, per_attention: float, count: int, slowed_every: int = 0):
    """Steps of a made-up device: 2 ms fixed, 0.1 ms a decode row, 1 µs a key its chunk gathers,
    the given prefill coefficients; every `slowed_every`-th step takes 5x as long (another process
    had the cores)."""
    rng = random.Random(0)
    for i in range(count):
        tokens, start, decodes = rng.randrange(1, 1025), rng.randrange(0, 16_000), rng.randrange(0, 9)
        attention = tokens * (start + tokens / 2)
        seconds = 2e-3 + 1e-4 * decodes + 1e-6 * start + per_token * tokens + per_attention * attention
        slowed = 5 if slowed_every and i % slowed_every == 0 else 1
        yield StepWork(tokens, attention, decodes, start), seconds * slowed


@pytest.mark.parametrize("slowed_every", [0, 10])
def test_the_attention_context_is_fitted_from_the_steps(slowed_every):
    cost = PrefillCost()
    steps = list(_synthetic_steps(3e-4, 3e-4 / 9000, 64, slowed_every))
    for work, seconds in steps[:REFIT_EVERY - 1]:
        cost.observe(work, seconds)
    assert not cost.measured and cost.attention_context == UNMEASURED_CONTEXT
    for work, seconds in steps[REFIT_EVERY - 1:]:
        cost.observe(work, seconds)
    assert cost.measured and cost.attention_context == pytest.approx(9000, rel=0.01)


def test_a_device_whose_attention_costs_nothing_measurable_gets_the_widest_context():
    cost = PrefillCost()
    for work, seconds in _synthetic_steps(3e-4, 0.0, 40):
        cost.observe(work, seconds)
    assert cost.attention_context == pytest.approx(CONTEXT_RANGE[1], rel=0.01)


def _engine(model_dir, threshold: int, budget: int = 256, **config) -> LLMEngine:
    return LLMEngine(pic_config(model_dir, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                                **config))


def _decoder(engine: LLMEngine, max_tokens: int = 200) -> Sequence:
    """A request decoding (cache_mode none: it keeps no checkpoint, so an abort frees all it holds)."""
    rid = engine.add_request(SegmentedPrompt.build(engine.tokenizer, "hello world", separator=SEP),
                             greedy(max_tokens), cache_mode="none")
    seq = engine.requests[rid].completions[0].seq
    while not seq.output_ids:
        engine.step()
    return seq


def _cold_request(engine: LLMEngine, doc: str = LONG_DOC, query: str = "the lazy dog", max_tokens: int = 4):
    """(the job's sequence, the request's sequence) of a request bringing `doc` cold."""
    prompt = SegmentedPrompt.build(engine.tokenizer, SEP.join([SYSTEM, doc, query]), separator=SEP)
    job, = engine.segment_jobs(prompt)
    rid = engine.add_request(prompt, greedy(max_tokens))
    return engine.pic.jobs[job.key], engine.requests[rid].completions[0].seq


def _step_progress(engine: LLMEngine, seq: Sequence) -> tuple[int, int, float]:
    """One step: (where seq's chunk started, its tokens, the L the scheduler counted it with)."""
    start, context = seq.num_computed, engine.scheduler.cost.attention_context
    engine.step()
    return start, seq.num_computed - start, context


def _run_to_end(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


def test_beside_a_decode_every_step_keeps_the_cold_job_under_the_cap(tiny_model_dir):
    engine = _engine(tiny_model_dir, CAP)
    decoder = _decoder(engine)
    job, cold = _cold_request(engine)
    steps = []
    while not job.finished:
        made = len(decoder.output_ids)
        start, tokens, context = _step_progress(engine, job)
        assert len(decoder.output_ids) == made + 1  # the decode ran in every step
        steps.append((start, tokens, context))
    floor = engine.caches.shape.conv_kernel - 1  # the conv-tail chunk of the interior's end
    assert all(0 < n and (PrefillCost(L).cost(p, n) <= CAP or n <= floor) for p, n, L in steps), steps
    assert len(steps) >= job.pic.job.interior[1] // CAP
    while not cold.output_ids:
        engine.step()


def test_a_job_on_the_cold_lane_is_neither_scheduled_nor_preempted_until_it_lands(tiny_model_dir):
    """While a job's chunk may still run on the cold lane (a GPU stream beside the step's), no job is
    scheduled and that one is never a preemption victim; the decodes go on. Here the flag is set by
    hand: on a CPU no chunk runs on a lane."""
    engine = _engine(tiny_model_dir, CAP)
    decoder = _decoder(engine)
    job, cold = _cold_request(engine)
    engine.step()
    started, made = job.num_computed, len(decoder.output_ids)
    assert started > 0
    job.pic.on_lane = True
    for _ in range(3):
        engine.step()
    assert job.num_computed == started and len(decoder.output_ids) == made + 3
    assert engine.scheduler._preemption_victim(decoder, ScheduledBatch()) is None  # the job is the only other
    job.pic.on_lane = False
    _run_to_end(engine)
    assert job.finished and len(cold.output_ids) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_cap_holds_and_the_outputs_are_uncapped_ones(slow_decay_model_dir):
    """The same through CUDA events (the step clock) and the GPU kernels: capped steps, equal tokens."""
    gpu = {"device": "cuda", "dtype": "float32", "gpu_memory_utilization": GPU_SHARE}
    outputs = []
    for threshold in (CAP, 0):
        engine = _engine(slow_decay_model_dir, threshold, **gpu)
        decoder = _decoder(engine, 40)
        job, cold = _cold_request(engine, max_tokens=8)
        steps = []
        while not job.finished:
            steps.append(_step_progress(engine, job))
        _run_to_end(engine)
        outputs.append((decoder.output_ids, cold.output_ids))
        if threshold:
            floor = engine.caches.shape.conv_kernel - 1
            assert all(PrefillCost(L).cost(p, n) <= CAP or n <= floor for p, n, L in steps)
    assert outputs[0] == outputs[1] and len(outputs[0][1]) == 8


def test_alone_the_cold_job_takes_the_whole_step_budget(tiny_model_dir):
    engine = _engine(tiny_model_dir, CAP, budget=64)
    job, cold = _cold_request(engine)
    assert _step_progress(engine, job)[1] == 64  # its request waits for it: nothing else is in flight
    assert cold.pic.blocked


def test_alone_a_long_uncached_prompt_is_prefilled_in_one_step(tiny_model_dir):
    """Nothing else in flight: a waiting long prompt does not hold itself up (one step, not two)."""
    engine = _engine(tiny_model_dir, CAP, budget=1024, cache_mode="none")
    rid = engine.add_request(SegmentedPrompt.build(engine.tokenizer, LONG_DOC, separator=SEP), greedy(2))
    long = engine.requests[rid].completions[0].seq
    assert long.remaining > CAP
    start, tokens, _ = _step_progress(engine, long)
    assert start == 0 and tokens == len(long.token_ids) - len(long.output_ids)


def test_a_long_uncached_prompt_beside_a_decode_is_capped_too(tiny_model_dir):
    engine = _engine(tiny_model_dir, CAP, cache_mode="none")
    decoder = _decoder(engine)
    rid = engine.add_request(SegmentedPrompt.build(engine.tokenizer, LONG_DOC, separator=SEP), greedy(2))
    long = engine.requests[rid].completions[0].seq
    steps = []
    while not long.output_ids:
        steps.append(_step_progress(engine, long))
    assert all(PrefillCost(L).cost(p, n) <= CAP for p, n, L in steps if n > 0) and len(steps) > 1
    assert len(decoder.output_ids) > len(steps)


@pytest.mark.parametrize("threshold", [CAP, 0])
def test_greedy_outputs_are_those_of_an_uncapped_run(slow_decay_model_dir, threshold):
    """Against the whole step budget (no cap, threshold 0) and a one-step capture (budget 1024)."""
    outputs = []
    for engine in (_engine(slow_decay_model_dir, threshold), _engine(slow_decay_model_dir, 0, budget=1024)):
        decoder = _decoder(engine, 40)
        _, cold = _cold_request(engine, max_tokens=8)
        _run_to_end(engine)
        outputs.append((decoder.output_ids, cold.output_ids))
    assert outputs[0] == outputs[1] and len(outputs[0][1]) == 8


def test_an_abort_mid_capped_capture_gives_everything_back(tiny_model_dir):
    engine = _engine(tiny_model_dir, CAP)
    baseline = _accounting(engine)
    decoder = _decoder(engine)
    job, cold = _cold_request(engine)
    for _ in range(3):
        engine.step()
    assert job.pic.captured is not None and 0 < job.num_computed < job.pic.job.interior[1]
    engine.abort(cold.info.request_id)
    assert not engine.pic.jobs and engine.store.stats().pinned == 0 and job.pic.job.key not in engine.store
    engine.abort(decoder.info.request_id)
    assert _accounting(engine) == baseline and not engine.has_work()


@pytest.mark.parametrize("threshold", [CAP, 0])
def test_a_warm_request_is_served_in_its_first_step_beside_a_cold_job(tiny_model_dir, threshold):
    """Even uncapped (threshold 0) the cold job's chunk comes after the warm request's."""
    engine = _engine(tiny_model_dir, threshold, budget=128)
    warm_prompt = SegmentedPrompt.build(engine.tokenizer, SEP.join([SYSTEM, DOCS[0], "hello"]), separator=SEP)
    engine.add_request(SegmentedPrompt.build(engine.tokenizer, SEP.join([SYSTEM, DOCS[0], "a warm-up"]),
                                             separator=SEP), greedy(1))
    _run_to_end(engine)
    job, _ = _cold_request(engine)
    engine.step()
    rid = engine.add_request(warm_prompt, greedy(1))
    warm = engine.requests[rid].completions[0].seq
    engine.step()
    assert warm.output_ids and not job.finished and warm.info.cached_tokens_by_kind["pic"] > 0


def test_a_short_prefill_gets_a_step_without_the_cold_jobs_chunk(tiny_model_dir):
    """A short prompt arriving while a cold job is captured chunk by chunk: its step holds no cold
    chunk (on a GPU the assembly graphs walk it beside the decodes' graph), and the next step
    resumes the job (never two steps in a row without it)."""
    engine = _engine(tiny_model_dir, CAP, budget=128)
    job, _ = _cold_request(engine)
    engine.step()
    progress = job.num_computed
    assert 0 < progress < job.pic.job.interior[1]
    rid = engine.add_request(SegmentedPrompt.build(engine.tokenizer, "hello world", separator=SEP), greedy(2))
    short = engine.requests[rid].completions[0].seq
    engine.step()
    assert short.num_computed > 0 and job.num_computed == progress
    engine.step()
    assert job.num_computed > progress


def test_a_cold_job_waits_for_short_prefills_at_most_two_steps_in_a_row(tiny_model_dir):
    """A new short prompt (no prefix hit: each starts differently) at every step while a cold job is
    captured: the job moves in every third step (LONG_WAITS), never starved."""
    engine = _engine(tiny_model_dir, CAP, budget=128)
    job, _ = _cold_request(engine)
    engine.step()
    moved = []
    for i in range(6):
        engine.add_request(SegmentedPrompt.build(engine.tokenizer, f"{i} hello world", separator=SEP), greedy(1))
        before = job.num_computed
        engine.step()
        moved.append(job.num_computed > before)
    assert moved == [False, False, True] * 2
