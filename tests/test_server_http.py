"""The HTTP layer over the real engine and the bundled model, driven by an aiohttp client:
every error status, disconnects that abort and free, overload, graceful shutdown, API keys, and a
fuzz of request bodies. One engine per module; the event loop runs in a background thread."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import pytest
import torch
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from server_util import assert_error

from hypic.config import EngineConfig
from hypic.serve.app import build_app, runner_for
from hypic.engine.client import InProcessEngineClient
from hypic.serve.server import drain
from hypic.serve.state import ServerSettings

T = TypeVar("T")
MODEL_LEN = 256
CHAT = [{"role": "user", "content": "Say something."}]


class LoopThread:
    """An event loop in a daemon thread; tests hand it coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Awaitable[T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


@dataclass
class Served:
    """One engine client behind an app on a free port."""

    client: InProcessEngineClient
    runner: web.AppRunner
    url: str
    session: aiohttp.ClientSession


async def _serve(client: InProcessEngineClient, settings: ServerSettings) -> Served:
    runner = runner_for(build_app(client, settings), access_log=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return Served(client, runner, f"http://127.0.0.1:{runner.addresses[0][1]}", aiohttp.ClientSession())


async def _engine(device: str = "cpu", **options: Any) -> InProcessEngineClient:
    config = EngineConfig(device=device, max_model_len=MODEL_LEN, cpu_cache_bytes=32 << 20,
                          **{"segment_host_bytes": 0, **options})
    client = InProcessEngineClient(config)
    await client.start()
    return client


async def _close(served: Served, *, stop_engine: bool) -> None:
    await served.session.close()
    await served.runner.cleanup()
    if stop_engine:
        await served.client.shutdown(0.0)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def served(loop: LoopThread) -> Iterator[Served]:
    served = loop.run(_serve(loop.run(_engine()), ServerSettings()))
    yield served
    loop.run(_close(served, stop_engine=True))


async def post(served: Served, path: str, body: object, **options: Any) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with served.session.post(served.url + path, data=data, **options) as response:
        text = await response.text()
        parsed = json.loads(text) if response.content_type == "application/json" else {"sse": text}
        return response.status, parsed, dict(response.headers)


async def get(served: Served, path: str, **options: Any) -> tuple[int, str]:
    async with served.session.get(served.url + path, **options) as response:
        return response.status, await response.text()


async def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _idle_and_accounted(client: InProcessEngineClient) -> bool:
    """Nothing runs or waits, and every page and slot is free or held by a prefix-cache checkpoint."""
    stats = client.stats()
    held = stats.prefix_cache
    return (stats.running, stats.waiting) == (0, 0) and (
        stats.kv_blocks_free + held.blocks_held == stats.kv_blocks_total
        and stats.state_slots_free + held.slots_held == stats.state_slots_total
    )


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b'{"prompt": "hi", ', 400, None),
        ("/v1/completions", b"", 400, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": [1, 999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "any"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
        ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "any"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "any"),
        ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
        ("/tokenize", {}, 400, "prompt"),
        ("/v1/nothing", {}, 404, None),
    ],
)
def test_errors_are_openai_json_with_the_right_status(loop, served, path, body, status, param) -> None:
    assert_error(*loop.run(post(served, path, body))[:2], status, param)


def test_prompt_over_the_context_reports_both_numbers(loop, served) -> None:
    status, body, _ = loop.run(post(served, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}))
    error = assert_error(status, body, 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "200" in error["message"] and str(MODEL_LEN) in error["message"]


def test_wrong_method_is_json_405(loop, served) -> None:
    status, text = loop.run(get(served, "/v1/completions"))
    assert_error(status, json.loads(text), 405)


# ---- disconnects -------------------------------------------------------------------------------


async def _disconnect_mid_stream(served: Served) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with served.session.post(served.url + "/v1/completions", json=body) as response:
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"data: ")
        assert served.client.stats().running == 1
        response.connection.transport.abort()  # the client vanishes mid-stream
    await wait_until(lambda: _idle_and_accounted(served.client))


def test_disconnect_mid_stream_aborts_and_frees(loop, served) -> None:
    aborted = served.client.stats().requests_aborted
    loop.run(_disconnect_mid_stream(served))
    assert served.client.stats().requests_aborted == aborted + 1


async def _disconnect_while_waiting(served: Served) -> None:
    body = {"messages": CHAT, "max_tokens": 200, "ignore_eos": True}
    request = asyncio.ensure_future(post(served, "/v1/chat/completions", body))
    await wait_until(lambda: served.client.stats().running == 1)
    request.cancel()  # closes the connection before any byte of the response
    await wait_until(lambda: _idle_and_accounted(served.client))


def test_disconnect_of_a_non_streamed_request_aborts_and_frees(loop, served) -> None:
    aborted = served.client.stats().requests_aborted
    loop.run(_disconnect_while_waiting(served))
    assert served.client.stats().requests_aborted == aborted + 1


# ---- API key -----------------------------------------------------------------------------------


def test_api_key_is_required_on_v1_but_not_on_probes(loop, served) -> None:
    keyed = loop.run(_serve(served.client, ServerSettings(api_key="sesame")))
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        assert_error(*loop.run(post(keyed, "/v1/completions", body))[:2], 401)
        wrong = {"Authorization": "Bearer open"}
        assert_error(*loop.run(post(keyed, "/v1/completions", body, headers=wrong))[:2], 401)
        right = {"Authorization": "Bearer sesame"}
        assert loop.run(post(keyed, "/v1/completions", body, headers=right))[0] == 200
        assert loop.run(get(keyed, "/health"))[0] == 200
        assert loop.run(get(keyed, "/metrics"))[0] == 200
        assert loop.run(get(keyed, "/v1/models"))[0] == 401
    finally:
        loop.run(_close(keyed, stop_engine=False))


def test_admin_cache_stats_and_flush_behind_the_api_key(loop, served) -> None:
    keyed = loop.run(_serve(served.client, ServerSettings(api_key="sesame")))
    right = {"Authorization": "Bearer sesame"}
    try:
        doc = "a document that several tenants read, long enough to have an interior to cache. " * 2
        body = {"prompt": f"sys<|segment|>{doc}<|segment|>question", "max_tokens": 1, "cache_salt": "t1"}
        assert loop.run(post(keyed, "/v1/completions", body, headers=right))[0] == 200
        assert loop.run(get(keyed, "/admin/cache"))[0] == 401
        status, text = loop.run(get(keyed, "/admin/cache", headers=right))
        stats = json.loads(text)
        assert status == 200 and stats["segment_pool"]["entries"] >= 1 and "hits" in stats["prefix_cache"]
        status, flushed, _ = loop.run(post(keyed, "/admin/cache/flush", {"cache_salt": "other"}, headers=right))
        assert status == 200 and flushed["flushed_segments"] == 0
        status, flushed, _ = loop.run(post(keyed, "/admin/cache/flush", {"cache_salt": "t1"}, headers=right))
        assert status == 200 and flushed["flushed_segments"] >= 1
        assert_error(*loop.run(post(keyed, "/admin/cache/flush", {"salt": 1}, headers=right))[:2], 400)
    finally:
        loop.run(_close(keyed, stop_engine=False))


# ---- fuzz --------------------------------------------------------------------------------------

_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
                  st.lists(st.integers(-5, 5000), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_TEXT = st.text(min_size=1, max_size=16)
_SAMPLING = {  # valid values; the fuzz then corrupts some
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**32), "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=2)),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 3071).map(str), st.floats(-100, 100), max_size=2),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
    "user": _TEXT, "cache_salt": _TEXT, "cache_mode": st.sampled_from(["none", "prefix", "naive", "hypic"]),
}
_SEGMENTS = st.lists(_TEXT, min_size=1, max_size=4)
_PROMPT = st.one_of(_TEXT, _SEGMENTS.map("<|segment|>".join), st.lists(st.integers(0, 3071), min_size=1, max_size=8),
                    st.lists(_TEXT, min_size=1, max_size=2))
_COMPLETION = st.one_of(
    st.fixed_dictionaries({"prompt": _PROMPT, "max_tokens": st.integers(0, 3)},
                          optional={"logprobs": st.integers(0, 5), "echo": st.booleans(), **_SAMPLING}),
    st.fixed_dictionaries({"segments": _SEGMENTS, "max_tokens": st.integers(0, 3)},
                          optional={"logprobs": st.integers(0, 5), "echo": st.booleans(), **_SAMPLING}),
)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _TEXT})
_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(0, 3)},
    optional={"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}), **_SAMPLING},
)
_FIELDS = sorted({*_SAMPLING, "prompt", "segments", "messages", "max_tokens", "logprobs", "echo", "tools", "bogus"})
_CORRUPTIONS = st.lists(st.tuples(st.sampled_from(_FIELDS), _JUNK), max_size=2)


def _corrupted(body: dict, corruptions: list[tuple[str, object]]) -> dict:
    return {**body, **dict(corruptions)}


_BODIES = st.one_of(
    st.builds(_corrupted, _COMPLETION, _CORRUPTIONS).map(lambda body: ("/v1/completions", body)),
    st.builds(_corrupted, _CHAT, _CORRUPTIONS).map(lambda body: ("/v1/chat/completions", body)),
)


# No shrinking: a request that hangs would be retried for minutes; the first failing body is reported as is.
@settings(max_examples=60, deadline=None, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(body=_BODIES)
def test_fuzzed_bodies_get_2xx_or_well_formed_4xx(loop, served, body) -> None:
    path, payload = body
    status, parsed, _ = loop.run(post(served, path, payload), timeout=30)
    assert status < 500, parsed
    if status >= 400:
        assert_error(status, parsed, status)
    elif "sse" in parsed:
        assert parsed["sse"].endswith("data: [DONE]\n\n")


def test_server_still_serves_after_the_fuzz(loop, served) -> None:
    status, body, _ = loop.run(post(served, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "ignore_eos": True}))
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert loop.run(get(served, "/health"))[0] == 200
    loop.run(wait_until(lambda: _idle_and_accounted(served.client)))


# ---- overload and graceful shutdown (their own engine: one sequence at a time, one waiting) ----


@pytest.fixture(scope="module")
def single(loop: LoopThread) -> Iterator[Served]:
    served = loop.run(_serve(loop.run(_engine(max_num_seqs=1, max_waiting=1)), ServerSettings()))
    yield served
    loop.run(_close(served, stop_engine=False))  # the shutdown test stopped it


async def _overload(served: Served) -> None:
    long = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with served.session.post(served.url + "/v1/completions", json=long) as running:
        await running.content.readline()  # the first request runs
        queued = asyncio.ensure_future(post(served, "/v1/completions", {**long, "stream": False}))
        await wait_until(lambda: served.client.stats().waiting == 1)  # the second one waits
        status, body, headers = await post(served, "/v1/completions", {"prompt": "b", "max_tokens": 1})
        assert_error(status, body, 503)
        assert int(headers["Retry-After"]) >= 1
        queued.cancel()
        running.connection.transport.abort()
    await wait_until(lambda: _idle_and_accounted(served.client))


def test_a_full_queue_answers_503_with_retry_after(loop, single) -> None:
    loop.run(_overload(single))


async def _graceful_shutdown(served: Served) -> None:
    body = {"prompt": "a", "max_tokens": 24, "ignore_eos": True, "stream": True}
    async with served.session.post(served.url + "/v1/completions", json=body) as in_flight:
        await in_flight.content.readline()
        draining = asyncio.ensure_future(drain(served.runner, grace_s=60.0))
        await wait_until(lambda: not served.client.accepting)
        late = await post(served, "/v1/completions", {"prompt": "late", "max_tokens": 1})
        assert_error(*late[:2], 503)
        assert late[2]["Retry-After"] == "30"  # the settings' shutdown grace (--shutdown-grace)
        assert (await get(served, "/health"))[0] == 503
        rest = (await in_flight.read()).decode()
    await draining
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # finished in full, not aborted
    assert rest.endswith("data: [DONE]\n\n")


def test_graceful_shutdown_finishes_in_flight_and_refuses_new(loop, single) -> None:
    loop.run(_graceful_shutdown(single))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_metrics_come_from_nvml(loop) -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    engine = loop.run(_engine("cuda", gpu_memory_utilization=0.05, enforce_eager=True))
    served = loop.run(_serve(engine, ServerSettings()))
    try:
        status, text = loop.run(get(served, "/metrics"))
        assert status == 200
        used = re.search(r'^hypic_gpu_memory_used_bytes\{gpu="\d+",model_name="[^"]+"\} (\S+)$', text, re.MULTILINE)
        total = re.search(r'^hypic_gpu_memory_total_bytes\{gpu="\d+",model_name="[^"]+"\} (\S+)$', text, re.MULTILINE)
        assert used and total and 0 < float(used.group(1)) <= float(total.group(1))
        assert re.search(r"^hypic_gpu_utilization_ratio\{", text, re.MULTILINE)
    finally:
        loop.run(_close(served, stop_engine=True))
