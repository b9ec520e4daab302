"""A cold PIC segment longer than the step budget is prefilled chunk by chunk (issue 26 item 2): its
tuple composes exactly across chunks, decodes keep running beside it, and an abort mid-capture
gives everything back. The reference is the same engine capturing the segment in one step."""
from __future__ import annotations

import pytest

import mamba2_models
from engine_util import GPU_SHARE, greedy
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from pic_util import DOCS, SEP, SYSTEM, pic_config, rel

LONG_DOC = " ".join(DOCS)  # ~300 tokens: ten chunks of a 32-token budget
CHUNKED = {"max_num_batched_tokens": 32}
ONE_STEP = {"max_num_batched_tokens": 1024}


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory: pytest.TempPathFactory):
    return mamba2_models.make_model_dir(tmp_path_factory.mktemp("nemotron_chunked"), "nemotron_h", slow_decay=True)


def _prompt(engine: LLMEngine, doc: str = LONG_DOC, query: str = "the lazy dog") -> SegmentedPrompt:
    return SegmentedPrompt.build(engine.tokenizer, SEP.join([SYSTEM, doc, query]), separator=SEP)


def _cold_run(model_dir, mode: str, **config) -> tuple[dict, list[int], list[float]]:
    """The stored tuple of LONG_DOC (prefilled cold for one request) and that request's output."""
    engine = LLMEngine(pic_config(model_dir, cache_mode=mode, **config))
    prompt = _prompt(engine)
    job, = engine.segment_jobs(prompt)
    assert len(job.token_ids) > CHUNKED["max_num_batched_tokens"]
    rid = engine.add_request(prompt, greedy(4, logprobs=0))
    tokens, logprobs = [], []
    while engine.has_work():
        for out in engine.step():
            for delta in out.deltas:
                tokens += delta.token_ids
                logprobs += [lp.logprob for lp in delta.logprobs or []]
    assert rid not in engine.requests and engine.store.stats().pinned == 0
    tup = engine.export_segment(job.key)
    return {name: getattr(tup, name) for name in ("T", "S0", "conv_tail", "K", "V")}, tokens, logprobs


def _assert_same_tuple(model_dir, mode: str, tolerance: float, **config) -> None:
    whole, whole_tokens, whole_logprobs = _cold_run(model_dir, mode, **ONE_STEP, **config)
    chunked, tokens, logprobs = _cold_run(model_dir, mode, **CHUNKED, **config)
    for name, layers in whole.items():
        assert len(chunked[name]) == len(layers)
        for got, want in zip(chunked[name], layers):
            assert got.shape == want.shape and want.norm() > 0 and rel(got.float(), want.float()) <= tolerance, name
    assert tokens == whole_tokens
    assert logprobs == pytest.approx(whole_logprobs, abs=1e-4)


@pytest.mark.parametrize("model, mode", [("gdn", "hypic"), ("gdn", "naive"), ("mamba2", "hypic")])
def test_a_segment_longer_than_the_step_budget_gives_the_one_step_tuple(model, mode, slow_decay_model_dir,
                                                                        nemotron_dir):
    model_dir = slow_decay_model_dir if model == "gdn" else nemotron_dir  # slow decay: T is far from 0
    _assert_same_tuple(model_dir, mode, 1e-5)


@pytest.mark.gpu
def test_on_the_gpu_a_chunked_capture_gives_the_one_step_tuple(slow_decay_model_dir):
    """The same through the Triton / fla kernels (float32; their chunked paths round differently)."""
    _assert_same_tuple(slow_decay_model_dir, "hypic", 1e-4, device="cuda", dtype="float32",
                       gpu_memory_utilization=GPU_SHARE)


def _decoding(engine: LLMEngine):
    rid = engine.add_request(SegmentedPrompt.build(engine.tokenizer, "hello world", separator=SEP), greedy(200))
    seq = engine.requests[rid].completions[0].seq
    while not seq.output_ids:
        engine.step()
    return seq


def _cold_request(engine: LLMEngine, max_tokens: int):
    """(its cold job, its request id) of a request bringing LONG_DOC cold."""
    prompt = _prompt(engine)
    job, = engine.segment_jobs(prompt)
    return job, engine.add_request(prompt, greedy(max_tokens))


def test_a_decode_makes_a_token_every_step_while_a_long_cold_segment_is_captured(tiny_model_dir):
    engine = LLMEngine(pic_config(tiny_model_dir, **CHUNKED))
    decoder = _decoding(engine)
    job, rid = _cold_request(engine, 1)
    cold = engine.requests[rid].completions[0].seq
    capture_steps = 0
    while not cold.output_ids:
        before = len(decoder.output_ids)
        capture_steps += bool(engine.pic.jobs)
        engine.step()
        assert len(decoder.output_ids) == before + 1
    # at most a budget's worth of the job a step: at least as many steps as budget-sized pieces
    assert capture_steps >= job.interior[1] // CHUNKED["max_num_batched_tokens"]
    assert not engine.pic.jobs and cold.info.cached_tokens_by_kind.get("pic", 0) == 0


def _accounting(engine: LLMEngine) -> tuple:
    stats = engine.store.stats()
    return (engine.blocks.num_free, engine.slots.num_free, stats.bytes, stats.pinned, len(engine.pic.jobs),
            dict(engine.pic.waiters))


def test_an_abort_mid_capture_gives_everything_back(tiny_model_dir):
    engine = LLMEngine(pic_config(tiny_model_dir, **CHUNKED))
    baseline = _accounting(engine)
    job, rid = _cold_request(engine, 4)
    for _ in range(3):
        engine.step()
    job_seq = engine.pic.jobs[job.key]
    assert job_seq.pic.captured is not None and 0 < job_seq.num_computed < job.interior[1]
    engine.abort(rid)
    assert _accounting(engine) == baseline
    assert not engine.has_work() and job.key not in engine.store
    # the engine goes on: the same prompt again is captured whole and served
    _cold_request(engine, 2)
    while engine.has_work():
        engine.step()
    assert job.key in engine.store and _accounting(engine)[2] > baseline[2]


def test_a_warm_request_is_served_while_a_long_cold_segment_is_still_being_captured(tiny_model_dir):
    engine = LLMEngine(pic_config(tiny_model_dir, **CHUNKED))
    warm_prompt = _prompt(engine, DOCS[0], query="hello")
    engine.add_request(_prompt(engine, DOCS[0], query="a warm-up"), greedy(1))
    while engine.has_work():
        engine.step()
    job, _ = _cold_request(engine, 1)
    engine.step()
    rid = engine.add_request(warm_prompt, greedy(1))
    warm = engine.requests[rid].completions[0].seq
    while not warm.output_ids:
        engine.step()
        assert job.key in engine.pic.jobs  # the cold job has not held it back to its end
    assert warm.info.cached_tokens_by_kind["pic"] > 0
