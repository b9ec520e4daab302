"""One step's device out-of-memory never kills the engine (issue 28): only the requests of that step
fail, with StepOutOfMemoryError (HTTP 503 + Retry-After); what they held comes back, nothing the step
computed is kept, and everyone else gets the tokens of a run without the fault. The fault is raised
inside the model's forward, after its first layers have written their state slots in place (or in
sampling, after the whole forward). Also:
the cache plan leaves room for the capture of cold segments, in numbers worked out by hand."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import aiohttp
import pytest
import torch
from aiohttp import web
from engine_util import GPU_SHARE, cpu_config, greedy
from pic_util import DOCS, SEP, SYSTEM, pic_config, prompt

from hypic.cache.memory_plan import CaptureWorkspace, longest_context, plan_beside_capture
from hypic.cache.model_caches import CacheShape, LinearShape
from hypic.cache.segment_store import SegmentLayout
from hypic.config import EngineConfig
from hypic.dist.remote_errors import error_info, raise_remote
from hypic.engine.client import InProcessEngineClient
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.errors import OutOfMemoryError, StepOutOfMemoryError
from hypic.kernels.linear_families import get_family
from hypic.serve.app import build_app, runner_for
from hypic.serve.state import ServerSettings

TORCH_MESSAGE = ("CUDA out of memory. Tried to allocate 640.00 MiB. GPU 0 has a total capacity of 139.80 GiB of "
                 "which 163.12 MiB is free.")
PROMPTS = ("hello world, the quick brown fox", "jumps over the lazy dog. " * 3, "naïve café résumé 1234",
           "A segment is tokenized on its own.")


class Fault:
    """Raises torch's out-of-memory error entering the model's last layer, once per `arm()`, in the
    forward `after` forwards from now."""

    def __init__(self, model: torch.nn.Module) -> None:
        last = [m for name, m in model.named_modules() if re.fullmatch(r".*layers\.\d+", name)][-1]
        last.register_forward_pre_hook(self._maybe_raise)
        self.countdown: int | None = None

    def arm(self, after: int = 0) -> None:
        self.countdown = after

    def _maybe_raise(self, *_: object) -> None:
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown < 0:
                self.countdown = None
                raise torch.OutOfMemoryError(TORCH_MESSAGE)


def _add(engine: LLMEngine, text: str | list[int], max_tokens: int = 4, **kwargs) -> str:
    prompt = SegmentedPrompt.build(engine.tokenizer, text, separator=SEP)
    return engine.add_request(prompt, greedy(max_tokens), **kwargs)


def _drain(engine: LLMEngine, tokens: dict[str, list[int]]) -> list:
    """Steps until idle, collecting each request's tokens; returns the outputs that carried an error."""
    failed = []
    while engine.has_work():
        for out in engine.step():
            failed += [out] if out.error is not None else []
            for delta in out.deltas:
                tokens.setdefault(out.request_id, []).extend(delta.token_ids)
    return failed


def _held(engine: LLMEngine) -> tuple[int, int, int, int, int]:
    """Free pages, free slots, pinned pool entries, prefix checkpoints, stored segments."""
    return (engine.blocks.num_free, engine.slots.num_free, engine.store.stats().pinned,
            engine.prefix.stats().checkpoints, engine.store.stats().entries)


def _reference(config: EngineConfig, texts: list[str]) -> list[list[int]]:
    engine = LLMEngine(config)
    tokens: dict[str, list[int]] = {}
    ids = [_add(engine, text) for text in texts]
    assert _drain(engine, tokens) == []
    return [tokens[i] for i in ids]


def test_an_out_of_memory_step_fails_only_its_requests(tiny_model_dir):
    config = cpu_config(tiny_model_dir, max_num_seqs=2)  # the third request waits for a seat
    engine = LLMEngine(config)
    fault, start = Fault(engine.model), _held(engine)
    first, second, queued = (_add(engine, text) for text in PROMPTS[:3])
    fault.arm()
    failed = engine.step()
    assert [out.request_id for out in failed] == [first, second]
    for out in failed:
        assert isinstance(out.error, StepOutOfMemoryError) and out.finished and not out.deltas
        assert (out.error.asked_bytes, out.error.free_bytes) == (640 << 20, int(163.12 * 2**20))
        # each prompt's first chunk stops one token short, at the checkpoint before its last token
        assert out.error.step_requests == 2 and out.error.step_tokens == sum(
            len(engine.tokenizer.encode(text)) - 1 for text in PROMPTS[:2])
    assert _held(engine) == start  # pages, slots, pins back; no checkpoint kept from the failed step
    stats = engine.stats()
    assert stats.running == 0 and stats.steps_out_of_memory == 1 and first not in engine.requests
    assert (stats.requests_failed, stats.requests_aborted) == (2, 0)  # failed, not aborted by a client
    later = _add(engine, PROMPTS[3])
    tokens: dict[str, list[int]] = {}
    assert _drain(engine, tokens) == []
    assert [tokens[queued], tokens[later]] == _reference(config, list(PROMPTS[2:4]))


def test_out_of_memory_in_sampling_fails_only_its_steps_requests(tiny_model_dir, monkeypatch):
    """Sampling's device work (a float32 copy of every row's logits, softmaxes) runs out of memory like
    the forward: the step's requests fail, forked completions (n=2) included, what they held comes
    back, and the queued request gets the tokens of a run without the fault."""
    config = cpu_config(tiny_model_dir, max_num_seqs=2)
    engine = LLMEngine(config)
    start, sample = _held(engine), engine.sampler.sample
    forked = engine.add_request(SegmentedPrompt.build(engine.tokenizer, PROMPTS[0], separator=SEP),
                                dataclasses.replace(greedy(4), n=2, temperature=0.8, seed=1))
    single, queued = _add(engine, PROMPTS[1]), _add(engine, PROMPTS[2])

    def failing(*args, **kwargs):
        monkeypatch.setattr(engine.sampler, "sample", sample)  # once
        raise torch.OutOfMemoryError(TORCH_MESSAGE)
    monkeypatch.setattr(engine.sampler, "sample", failing)
    failed = []
    while not failed:
        failed = [out for out in engine.step() if out.error is not None]
    assert sorted(out.request_id for out in failed) == sorted([forked, single])
    assert all(isinstance(out.error, StepOutOfMemoryError) for out in failed)
    assert engine.stats().running == 0 and engine.stats().steps_out_of_memory == 1
    engine.prefix.clear()  # the checkpoints the first (good) step kept hold their own pages and slots
    assert _held(engine) == start  # the failed step's: pages, slots, the forked completion's too
    tokens: dict[str, list[int]] = {}
    assert _drain(engine, tokens) == []
    assert [tokens[queued]] == _reference(config, [PROMPTS[2]])


def test_a_fault_in_a_decode_step_keeps_no_checkpoint_of_its_half_written_state(tiny_model_dir):
    """The failed request would have kept a checkpoint of everything it computed, in a state slot
    the step's first layers had already moved on: its tokens so far, asked again, must compute from
    an honest state and give the tokens of a run without the fault."""
    config = cpu_config(tiny_model_dir, max_num_seqs=1)
    engine = LLMEngine(config)
    fault = Fault(engine.model)
    decoding = _add(engine, PROMPTS[0], max_tokens=6)
    seq = engine.requests[decoding].sequences[0]
    while len(seq.output_ids) < 2:
        engine.step()
    so_far, checkpoints = list(seq.token_ids), engine.prefix.stats().checkpoints
    fault.arm()
    failed = engine.step()
    assert [(out.request_id, type(out.error)) for out in failed] == [(decoding, StepOutOfMemoryError)]
    assert engine.prefix.stats().checkpoints == checkpoints
    again = _add(engine, so_far)
    tokens: dict[str, list[int]] = {}
    assert _drain(engine, tokens) == []
    assert tokens[again] == _reference(config, [so_far])[0]


def test_a_cold_segment_whose_step_fails_is_not_stored_and_its_request_computes_it(tiny_model_dir):
    engine = LLMEngine(pic_config(tiny_model_dir))
    fault, start = Fault(engine.model), _held(engine)
    text = SEP.join([SYSTEM, DOCS[0], "the lazy dog"])
    waiting = _add(engine, text)
    assert len(engine.pic.jobs) == 1  # the document's cold prefill, which the request waits for
    fault.arm()
    assert engine.step() == []  # a step of only the cold job: no request failed
    assert _held(engine) == start and not engine.pic.jobs
    tokens: dict[str, list[int]] = {}
    assert _drain(engine, tokens) == []
    assert engine.store.stats().pinned == 0
    assert tokens[waiting] == _reference(pic_config(tiny_model_dir, cache_mode="none"), [text])[0]


def test_a_failed_assembly_step_gives_back_its_pins_and_its_checkpoint_slot(tiny_model_dir):
    """A warm request composes stored documents and keeps the state before its last token in a slot
    of its own, all in one step: failed, its pieces are unpinned and the slot goes back empty."""
    config = pic_config(tiny_model_dir)
    warm_up, target = prompt(*reversed(DOCS), query="?"), prompt(*DOCS)  # another order: no prefix hit
    engine = LLMEngine(config)
    fault, tokens = Fault(engine.model), {}
    _add(engine, warm_up)
    assert _drain(engine, tokens) == []
    held = _held(engine)
    failed = _add(engine, target)
    fault.arm()
    assert [(out.request_id, type(out.error)) for out in engine.step()] == [(failed, StepOutOfMemoryError)]
    assert _held(engine) == held
    again = _add(engine, target)
    assert _drain(engine, tokens) == []
    assert tokens[again] == _reference(config, [warm_up, target])[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_out_of_memory_is_survived_and_its_cache_given_back(tiny_model_dir):
    """A step asks the device for more than it has: the request fails with torch's figures, the
    allocator's cache goes back (empty_cache) and the next request gets the reference tokens."""
    config = cpu_config(tiny_model_dir, device="cuda", dtype="float32", gpu_memory_utilization=GPU_SHARE)
    engine = LLMEngine(config)
    too_much = torch.cuda.get_device_properties(0).total_memory * 2
    last = [m for name, m in engine.model.named_modules() if re.fullmatch(r".*layers\.\d+", name)][-1]
    hook = last.register_forward_pre_hook(lambda *_: torch.empty(too_much, dtype=torch.uint8, device="cuda"))
    failed, reserved = _add(engine, PROMPTS[0]), torch.cuda.memory_reserved()
    outputs = [out for _ in range(4) for out in engine.step()]
    hook.remove()
    assert [(out.request_id, type(out.error)) for out in outputs] == [(failed, StepOutOfMemoryError)]
    assert outputs[0].error.asked_bytes == pytest.approx(too_much, rel=1e-3) and outputs[0].error.free_bytes
    assert torch.cuda.memory_reserved() <= reserved + (16 << 20)  # the failed step's blocks went back
    later = _add(engine, PROMPTS[1])
    tokens: dict[str, list[int]] = {}
    assert _drain(engine, tokens) == []
    assert tokens[later] == _reference(config, [PROMPTS[1]])[0]


def test_the_error_crosses_processes_with_its_numbers():
    error = StepOutOfMemoryError(2048, 3, 640 << 20, None, retry_after=2.0)
    with pytest.raises(StepOutOfMemoryError) as raised:
        raise_remote(error_info(error), "node-1")
    again = raised.value
    assert (again.step_tokens, again.step_requests, again.asked_bytes, again.free_bytes, again.retry_after) == (
        2048, 3, 640 << 20, None, 2.0)
    assert str(again) == str(error)


# ---- what the capture of cold segments holds -------------------------------------------------------


def _two_documents(engine: LLMEngine) -> tuple[str, list]:
    text = SEP.join([SYSTEM, DOCS[0], DOCS[2], "the lazy dog"])
    return text, engine.segment_jobs(SegmentedPrompt.build(engine.tokenizer, text, separator=SEP))


def test_a_partial_job_keeps_only_its_own_tuple_rows(tiny_model_dir):
    """A step that ends one cold job and cuts the next keeps, for the one cut, its own (T, S0) of
    every linear layer, not the step's [jobs, ...] tensors."""
    probe = LLMEngine(pic_config(tiny_model_dir))
    text, jobs = _two_documents(probe)
    budget = max(len(job.token_ids) for job in jobs) + 20  # one job whole, 20 tokens of the other
    engine = LLMEngine(pic_config(tiny_model_dir, max_num_batched_tokens=budget))
    _add(engine, text)
    engine.step()
    partial, = [seq for seq in engine.pic.jobs.values() if seq.pic.captured is not None]
    assert engine.store.stats().entries == 1
    for t in (*partial.pic.captured.T, *partial.pic.captured.S0):
        assert t.untyped_storage().nbytes() == t.nbytes


def _job_steps(model_dir, text: str, budget: int, **limits) -> tuple[list[int], list[tuple[int, ...]]]:
    """The request's tokens, and each step's cold-job chunk lengths, under `limits`."""
    engine = LLMEngine(pic_config(model_dir, max_num_batched_tokens=budget))
    engine.scheduler.limits = dataclasses.replace(engine.scheduler.limits, **limits)
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        batch = schedule()
        steps.append(tuple(c.chunk.num_tokens for c in batch.chunks if c.seq.pic.job is not None))
        return batch
    engine.scheduler.schedule = recorded
    tokens: dict[str, list[int]] = {}
    request = _add(engine, text)
    assert _drain(engine, tokens) == []
    return tokens[request], steps


@pytest.mark.parametrize("bound", ["capture_jobs", "partial_jobs"])
def test_capture_bounds_hold_and_change_no_token(tiny_model_dir, bound):
    """At most `capture_jobs` cold jobs capture in a step, and one that would start a partial tuple
    waits while `partial_jobs` are kept; the request's tokens stay those of an unbounded run."""
    text, jobs = _two_documents(LLMEngine(pic_config(tiny_model_dir)))
    budget = max(len(job.token_ids) for job in jobs) + 20  # one job whole and a part of the other
    free_tokens, free_steps = _job_steps(tiny_model_dir, text, budget)
    tokens, steps = _job_steps(tiny_model_dir, text, budget, **{bound: 1 if bound == "capture_jobs" else 0})
    assert max(map(len, free_steps)) == 2 and max(map(len, steps)) == 1
    assert tokens == free_tokens


def test_a_kept_partial_that_ends_lets_the_next_job_start_one(tiny_model_dir):
    """With one partial tuple kept at a time, a step that finishes the kept one starts the next job's
    in its tail: the schedule is that of unbounded partial tuples."""
    text, jobs = _two_documents(LLMEngine(pic_config(tiny_model_dir)))
    budget = min(len(job.token_ids) for job in jobs) * 3 // 4  # every job is cut
    one = _job_steps(tiny_model_dir, text, budget)
    assert one == _job_steps(tiny_model_dir, text, budget, partial_jobs=8)
    assert any(len(step) == 2 for step in one[1])  # a step that ends one job and starts the other


# ---- the server: 503 with Retry-After, and an error event on a stream ----------------------------


async def _served_fault() -> tuple[list, str]:
    client = InProcessEngineClient(EngineConfig(device="cpu", max_model_len=256, cpu_cache_bytes=32 << 20,
                                                segment_host_bytes=0))
    await client.start()
    runner = runner_for(build_app(client, ServerSettings()), access_log=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
    fault, body = Fault(client.core.model), {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            # in the first step; in a step after the stream's first event (a prefill takes at most two); none
            for stream, after in ((False, 0), (True, 3), (False, None)):
                if after is not None:
                    fault.arm(after)
                async with session.post(url, json={**body, "stream": stream}) as response:
                    answers.append((response.status, response.headers.get("Retry-After"), await response.text()))
    finally:
        await runner.cleanup()
        await client.shutdown(0.0)
    return answers


def test_the_server_answers_503_with_retry_after_and_keeps_serving():
    (status, retry, text), (stream_status, _, events), (after, _, ok) = asyncio.run(_served_fault())
    error = json.loads(text)["error"]
    assert (status, retry, error["code"], error["type"]) == (503, "1", "step_out_of_memory", "service_unavailable")
    assert "640.0 MiB" in error["message"] and "retry" in error["message"]
    assert stream_status == 200 and events.endswith("data: [DONE]\n\n")
    streamed = json.loads(events.split("data: ")[-2])["error"]
    assert streamed["code"] == "step_out_of_memory"
    assert events.count('"text"') >= 1  # tokens came before the error
    assert after == 200 and json.loads(ok)["usage"]["completion_tokens"] == 8


# ---- the memory plan: the capture workspace comes off the cache budget -----------------------------

# Three GDN layers (HV 2, K = V = 4, conv 8 channels, W 4) and two full layers (2 KV heads of 4), bf16:
# float32 tuple per layer: 4 * (2*4*4 + 2*4*4) = 256 bytes; an entry's fixed part: T, S0 and conv blocks of
# 3 * 64, 3 * 64 and 3 * 48 bytes, each aligned to 256: 768; one row's K/V: 2 layers * 2 * 2 heads * 4 * 2 = 64
# bytes. Steps of 128 tokens, 16 jobs and 1 partial: staging 16 * 768 + 128 * 64 = 20480, one layer's tuples
# (16 + 128 / 64 + 16) * 256 = 8704, the partial job's tuples 2 * 3 * 256 = 1536: 30720 bytes, and 64 bytes
# a context token (the partial job's K/V rows).
SHAPE = CacheShape(full_layers=(3, 7), linear_layers=(0, 1, 2), num_kv_heads=2, head_dim=4,
                   linear=(LinearShape(get_family("gdn"), value_heads=2, key_dim=4, value_dim=4, conv_dim=8,
                                       conv_kernel=4),) * 3)
LAYOUT = SegmentLayout.from_cache_shape(SHAPE, torch.bfloat16, torch.bfloat16)
WORKSPACE = CaptureWorkspace.of(LAYOUT, step_tokens=128)
PLAN = dict(block_size=4, dtype=torch.bfloat16, max_num_seqs=4)  # pages of 256 bytes, slots of 528


def test_capture_workspace_from_the_shapes():
    assert LAYOUT.fixed_bytes == 768
    assert WORKSPACE == CaptureWorkspace(30720, 64) and WORKSPACE.total(64) == 34816
    assert CaptureWorkspace.of(LAYOUT, step_tokens=0) == CaptureWorkspace(0, 0)  # CPU: the budget is the caches'


def test_the_plan_leaves_the_capture_workspace_free():
    plan, context = plan_beside_capture(SHAPE, WORKSPACE, budget_bytes=100_000, max_model_len=64,
                                        fit_context=False, **PLAN)
    # 8 slots; (100000 - 34816 - 8 * 528) // 256 = 238 pages, not (100000 - 8 * 528) // 256 = 374
    assert context == 64 and (plan.num_slots, plan.num_blocks) == (8, 238)


def test_a_fitted_context_leaves_room_for_its_partial_jobs_rows():
    plan, context = plan_beside_capture(SHAPE, WORKSPACE, budget_bytes=100_000, max_model_len=4096,
                                        fit_context=True, **PLAN)
    # 100000 - 30720 = 69280; less 8 slots: 65056 for pages of 256 bytes and 4 * 64 bytes of workspace
    # each: 127 pages, 508 tokens (not 374 pages, 1496 tokens); 69280 - 508 * 64 = 36768 for the cache:
    # (36768 - 8 * 528) // 256 = 127 pages, one full context
    assert context == 508 and (plan.num_slots, plan.num_blocks) == (8, 127)
    assert longest_context(SHAPE, budget_bytes=100_000, **PLAN) == 1496


def test_a_budget_the_workspace_leaves_too_small_says_so():
    with pytest.raises(OutOfMemoryError, match="34816 bytes .* capturing cold segments"):
        plan_beside_capture(SHAPE, WORKSPACE, budget_bytes=34816 + 64 * 64, max_model_len=64, fit_context=False,
                            **PLAN)
