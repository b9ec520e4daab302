"""Segment parallelism across processes (CPU): three engine nodes joined by the TCP transport give the
single-process `hypic` engine's greedy tokens and logprobs for cold, warm and mixed requests, and
survive a worker killed or frozen in the middle of a request, the generating node killed mid-stream
included (`--workers 3` behind the HTTP server); a node busy for longer than the hang timeout is not
declared hung.

One cluster serves the whole module (starting engine processes is the expensive part); the tests
run in file order and each builds on the state the previous ones left.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from contextlib import aclosing
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from engine_util import Finished, collect, greedy
from pic_util import SEP, SYSTEM, pic_config

from hypic import AsyncEngine, PromptTooLongError
from hypic.engine.text.tokenizer import Tokenizer
from hypic.dist.client import DistributedEngineClient
from hypic.dist.config import DistConfig
from hypic.dist.client import start_cluster
from hypic.dist.messages import Build
from hypic.engine.client import GenerateRequest
from hypic.serve.app import build_app, runner_for
from hypic.serve.state import ServerSettings

pytestmark = pytest.mark.timeout(600)

WORDS = ("river", "lantern", "copper", "meadow", "harbor", "violet", "summit", "ember", "canyon", "willow",
         "orbit", "saffron", "glacier", "thistle", "quartz", "bramble", "falcon")
DOCS = [f"Doc {i}: the {w} archive lists {w}s near {WORDS[(i + 3) % len(WORDS)]} street. "
        for i, w in enumerate(WORDS)]


def prompt(docs: list[int], query: str = "which street?") -> str:
    return SEP.join([SYSTEM, *(DOCS[i] for i in docs), query])


COLD = prompt([0, 1, 2])
WARM = prompt([2, 0, 1], "where are the lanterns?")  # all on the cold request's combine node
PULLED = prompt([1, 2, 0], "and the meadows?")  # that node busy: another combines, pulling from holders
MIXED = prompt([1, 3, 4, 0], "and the copper?")
KILLED = prompt([5, 6, 7, 8, 9, 10])  # two segments per node
FROZEN = prompt([11, 12, 13, 14, 15, 16])
PARAMS = greedy(4, logprobs=0)
COMBINE_OF: dict[str, int] = {}  # request -> its combine node, for the tests that follow


class LoopThread:
    """An event loop of its own for the cluster client, shared by the module's tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


@pytest.fixture(scope="module")
def reference(slow_decay_model_dir) -> dict[str, Finished]:
    """Each prompt on one engine in one process (the same order the cluster sees them)."""
    async def main() -> dict[str, Finished]:
        async with AsyncEngine(pic_config(slow_decay_model_dir)) as engine:
            return {p: await collect(engine, p, PARAMS) for p in (COLD, WARM, PULLED, MIXED, KILLED, FROZEN)}
    return asyncio.run(main())


@pytest.fixture(scope="module")
def cluster(slow_decay_model_dir):
    loop = LoopThread()
    dist = DistConfig(min_remote_tokens=0, heartbeat_s=0.2, node_timeout_s=3.0, segment_timeout_s=120.0)
    client = start_cluster(pic_config(slow_decay_model_dir), 3, None, "cpu", dist)
    loop.run(client.start(), timeout=400)
    yield loop, client
    loop.run(client.shutdown(0.0), timeout=120)
    loop.close()


def on_first_remote_build(client: DistributedEngineClient, signum: int) -> list[int]:
    """Signal the first worker the router sends a Build for another node's request, just before it
    goes out: the worker holds none of that request's segments yet, whatever the timing."""
    victims: list[int] = []
    for node in client.cluster.nodes.values():
        def send(message, node=node, send=node.link.send):
            if isinstance(message, Build) and message.dest_node != node.node_id and not victims:
                victims.append(node.node_id)
                os.kill(client.nodes.pid(node.node_id), signum)
            return send(message)
        node.link.send = send
    return victims


def generate(loop: LoopThread, client: DistributedEngineClient, text: str, request_id: str) -> Finished:
    async def main() -> Finished:
        done = Finished()
        async for out in client.stream(GenerateRequest(text, PARAMS, request_id)):
            for d in out.deltas:
                done.token_ids.setdefault(d.index, []).extend(d.token_ids)
                done.logprobs.setdefault(d.index, []).extend(d.logprobs or ())
                done.finish_reason[d.index] = d.finish_reason
            done.metrics = out.metrics
        return done
    return loop.run(main())


def assert_same(got: Finished, want: Finished) -> None:
    assert got.tokens == want.tokens
    assert [x.logprob for x in got.logprobs[0]] == pytest.approx([x.logprob for x in want.logprobs[0]], abs=1e-5)


def assert_idle(loop: LoopThread, client: DistributedEngineClient) -> None:
    """Every page and slot in use is a prefix checkpoint's; no transfer buffer or job is left."""
    for node_id in list(client.cluster.nodes):
        reply = loop.run(client.probe(node_id))
        s, c = reply.stats, reply.counters
        assert (s["running"], s["waiting"]) == (0, 0), node_id
        assert s["kv_blocks_total"] - s["kv_blocks_free"] == s["prefix_cache"]["blocks_held"], node_id
        assert s["state_slots_total"] - s["state_slots_free"] == s["prefix_cache"]["slots_held"], node_id
        assert s["segment_pool"]["pinned"] == 0, node_id
        assert (c.pending_receives, c.pending_receive_bytes, c.active_segment_jobs) == (0, 0, 0), node_id


def settled(since: float) -> Callable[[Any], bool]:
    """Three nodes answering, none with work left, as their heartbeats after `since` say."""
    def check(cluster) -> bool:
        nodes = cluster.usable()
        return len(nodes) == 3 and all(n.last_heartbeat > since and n.stats["running"] == 0
                                       and n.counters.active_segment_jobs == 0 for n in nodes)
    return check


def test_cold_request_is_spread_over_the_nodes_and_matches_one_engine(cluster, reference):
    loop, client = cluster
    got = generate(loop, client, COLD, "cold")
    assert_same(got, reference[COLD])
    dist = got.metrics.dist
    COMBINE_OF["cold"] = dist.combine_node
    assert dist.segments == 3 and dist.segments_built == 3 and dist.segments_remote == 2 and dist.workers == 3
    assert dist.dispatch_s > 0 and dist.combine_s > 0 and got.metrics.ttft >= dist.dispatch_s
    assert got.metrics.cached_tokens_by_kind["pic"] > 0
    assert_idle(loop, client)


def test_warm_request_runs_locally_on_the_node_holding_its_segments(cluster, reference):
    loop, client = cluster
    got = generate(loop, client, WARM, "warm")
    assert_same(got, reference[WARM])
    assert got.metrics.dist is None  # nothing to gather: the local path
    assert got.metrics.cached_tokens_by_kind["pic"] == reference[WARM].metrics.cached_tokens_by_kind["pic"] > 0


def test_segments_held_elsewhere_are_pulled_not_rebuilt(cluster, reference):
    loop, client = cluster
    holder = COMBINE_OF["cold"]  # holds every segment of the prompt
    client.cluster.nodes[holder].pending_tokens += 1 << 20  # busy: another node must combine
    try:
        got = generate(loop, client, PULLED, "pulled")
    finally:
        client.cluster.nodes[holder].pending_tokens -= 1 << 20
    assert_same(got, reference[PULLED])
    dist = got.metrics.dist
    assert dist.combine_node != holder
    assert dist.segments_built == 0 and dist.segments_local == 1 and dist.segments_pulled == 2


def test_mixed_request_pulls_what_is_held_and_builds_the_rest(cluster, reference):
    loop, client = cluster
    got = generate(loop, client, MIXED, "mixed")
    assert_same(got, reference[MIXED])
    dist = got.metrics.dist
    assert dist.segments_built == 2 and dist.segments_local + dist.segments_pulled == 2
    assert_idle(loop, client)


def test_typed_errors_cross_processes_and_aborts_free_everything(cluster):
    loop, client = cluster
    with pytest.raises(PromptTooLongError):
        generate(loop, client, prompt(list(range(len(DOCS))) * 2), "too-long")

    async def abort_after_first_output() -> list:
        outputs = []
        async for out in client.stream(GenerateRequest(prompt([0, 1]), greedy(200), "aborted")):
            outputs.append(out)
            if len(outputs) == 1:
                await client.abort("aborted")
        return outputs

    async def leave_after_first_output() -> None:
        async with aclosing(client.stream(GenerateRequest(prompt([2, 0]), greedy(200), "left"))) as outputs:
            async for _ in outputs:
                break
    outputs = loop.run(abort_after_first_output())
    assert outputs[-1].finished and outputs[-1].deltas[-1].finish_reason == "abort"
    loop.run(leave_after_first_output())
    loop.run(client.cluster.wait_until(settled(time.monotonic()), timeout=60), timeout=70)
    assert_idle(loop, client)


def test_a_worker_killed_mid_request_costs_latency_not_the_request_and_restarts(cluster, reference):
    loop, client = cluster
    before = client.stats().dist
    victims = on_first_remote_build(client, signal.SIGKILL)
    got = generate(loop, client, KILLED, "killed")
    assert_same(got, reference[KILLED])
    assert victims and got.metrics.dist.segments_redispatched >= 1
    assert client.stats().dist.node_deaths == before.node_deaths + 1
    assert_idle(loop, client)  # the survivors (the victim may not be back yet)
    loop.run(client.cluster.wait_until(settled(time.monotonic()), timeout=300), timeout=310)
    after = client.stats().dist
    assert after.node_restarts == before.node_restarts + 1 and after.nodes_live == 3


def test_a_frozen_worker_is_timed_out_and_rejoins_when_it_wakes(cluster, reference):
    loop, client = cluster
    before = client.stats().dist
    frozen = on_first_remote_build(client, signal.SIGSTOP)
    try:
        got = generate(loop, client, FROZEN, "frozen")
    finally:
        for node_id in frozen:
            os.kill(client.nodes.pid(node_id), signal.SIGCONT)
    assert_same(got, reference[FROZEN])
    assert frozen and got.metrics.dist.segments_redispatched >= 1
    loop.run(client.cluster.wait_until(settled(time.monotonic()), timeout=60), timeout=70)  # leftovers end
    assert_idle(loop, client)
    after = client.stats().dist
    assert after.node_hangs == before.node_hangs + 1
    assert (after.node_deaths, after.node_restarts) == (before.node_deaths, before.node_restarts)


def test_flush_reaches_every_node_and_the_directory(cluster):
    loop, client = cluster
    assert loop.run(client.flush_cache("no-such-tenant")) == 0
    assert loop.run(client.flush_cache(None)) > 0  # the earlier tests left segments on the nodes
    assert len(client.router.directory) == 0
    assert loop.run(client.flush_cache(None)) == 0


RESUMED = prompt([3, 5, 7], "name every street you know, one by one:")
STREAMED = {"prompt": RESUMED, "n": 2, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True,
            "frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.3}


async def stream_texts(url: str, on_first_text: Callable[[], None] = lambda: None) -> dict[int, str]:
    """The completions' texts as an SSE client reads them; `on_first_text` runs once text arrived."""
    texts: dict[int, str] = {}
    async with aiohttp.ClientSession() as session, session.post(url, json=STREAMED) as response:
        assert response.status == 200
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if any(texts.values()) and on_first_text is not None:
                on_first_text()
                on_first_text = None
    return texts


def kill_generating_node(client: DistributedEngineClient) -> None:
    [node] = [n for n in client.cluster.nodes.values() if n.running]
    os.kill(client.nodes.pid(node.node_id), signal.SIGKILL)


def test_the_generating_node_killed_mid_stream_costs_the_stream_nothing(cluster):
    loop, client = cluster
    before = client.stats().dist

    async def main() -> tuple[dict[int, str], dict[int, str]]:
        runner = runner_for(build_app(client, ServerSettings()), access_log=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        try:
            return await stream_texts(url), await stream_texts(url, lambda: kill_generating_node(client))
        finally:
            await runner.cleanup()
    undisturbed, killed = loop.run(main())
    assert killed == undisturbed and set(killed) == {0, 1} and all(killed.values())
    after = client.stats().dist
    assert after.requests_resumed == before.requests_resumed + 1
    assert after.node_deaths == before.node_deaths + 1
    loop.run(client.cluster.wait_until(settled(time.monotonic()), timeout=300), timeout=310)  # it restarted


def huge_prompt(model_dir, seconds: float) -> str:
    """A prompt that takes a node about `seconds` to tokenize (timed here on a small part)."""
    part = " ".join(WORDS) + "; "
    sample = part * 4000
    start = time.monotonic()
    Tokenizer.from_dir(model_dir).encode(sample)
    return sample * max(1, int(seconds / (time.monotonic() - start)))


def test_a_node_busy_tokenizing_a_huge_prompt_is_not_declared_hung(cluster, slow_decay_model_dir):
    loop, client = cluster
    timeout = client.dist.node_timeout_s
    huge = huge_prompt(slow_decay_model_dir, 2 * timeout)
    before = client.stats().dist

    async def main() -> tuple[float, float, float, str]:
        silences = [0.0]
        big = asyncio.ensure_future(collect_error(client.stream(GenerateRequest(huge, greedy(4), "huge"))))
        while not any(time.monotonic() - n.last_heartbeat > 1.0 for n in client.cluster.nodes.values()):
            await asyncio.sleep(0.02)  # its planner is tokenizing: its event loop no longer heartbeats
        small = generate_async(client, prompt([0]), "beside-huge")
        small_done = asyncio.ensure_future(small)
        while not big.done():
            silences.append(max(time.monotonic() - n.last_heartbeat for n in client.cluster.nodes.values()))
            await asyncio.sleep(0.05)
        await small_done
        return max(silences), small_done.result(), time.monotonic(), big.result()
    longest_silence, small_finished, big_failed, error = loop.run(main())
    assert longest_silence > timeout  # heartbeats alone would have called it hung
    assert error == "PromptTooLongError"  # the request's own answer, not a 503 for a lost node
    assert small_finished < big_failed  # the other request was served meanwhile, on another node
    assert client.stats().dist.node_hangs == before.node_hangs


async def collect_error(outputs) -> str:
    try:
        async for _ in outputs:
            pass
    except Exception as error:  # noqa: BLE001 - the test reads which error it was
        return type(error).__name__
    return "none"


async def generate_async(client: DistributedEngineClient, text: str, request_id: str) -> float:
    """Runs a short request; when it finished."""
    async for out in client.stream(GenerateRequest(text, PARAMS, request_id)):
        assert out.deltas
    return time.monotonic()
