"""Hostile and careless clients against `python -m hypic.serve` as a real process (issue 23).

One server for the module, with small limits so that each attack is cheap: bodies that nest deep,
carry huge integers or huge strings, prompts that cannot fit, floods of prompts x n, refused
batches, slow and idle sockets, too many connections, a credential with a NUL byte, a burst of
maximal bodies (memory after it) and SIGTERM (last: it stops the server). Every answer is a 2xx or
a well-formed 4xx, and /health answers within a second throughout.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from server_util import assert_error

ROOT = Path(__file__).resolve().parent.parent
KEY = "hostile-secret-7421"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL_LEN = 512
BODY_LIMIT = 8 << 20
HEADER_TIMEOUT = 1.5
MAX_CONNECTIONS = 24
MAX_SEQUENCES = 128
MAX_WAITING = 64
GRACE_S = 7
CHAT = [{"role": "user", "content": "hi"}]
NORMAL = {"prompt": "Note: the code is 1234. Answer:", "max_tokens": 2, "ignore_eos": True}


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def rss(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    command = [sys.executable, "-m", "hypic.serve", "--device", "cpu", "--port", "0", "--api-key", KEY,
               "--max-model-len", str(MODEL_LEN), "--cpu-cache-bytes", "32MiB", "--max-waiting", str(MAX_WAITING),
               "--max-body-bytes", str(BODY_LIMIT), "--header-timeout", str(HEADER_TIMEOUT),
               "--body-timeout", "2", "--max-connections", str(MAX_CONNECTIONS),
               "--max-sequences-per-request", str(MAX_SEQUENCES), "--shutdown-grace", str(GRACE_S)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    line = process.stdout.readline()
    match = re.search(r"at (http://\S+) on", line)
    assert match, f"no start-up line; got {line!r}; log: {log.read_text()[-2000:]}"
    yield Server(process, match.group(1), log)
    if process.poll() is None:
        process.kill()
    process.wait()


async def _post(url: str, body: object, **options) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    headers = {**AUTH, "Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(url, data=data, headers=headers, **options) as response:
            text = await response.text()
            parsed = json.loads(text) if response.content_type == "application/json" else {"sse": text}
            return response.status, parsed, dict(response.headers)


def post(server: Server, path: str, body: object) -> tuple[int, dict, dict]:
    return asyncio.run(_post(server.url + path, body))


async def _health_while(url: str, attack) -> tuple[object, float]:
    """Runs `attack` while asking /health every 20 ms; its result and /health's worst latency."""
    worst, done = 0.0, asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        async with aiohttp.ClientSession() as session:
            while not done.is_set():
                start = time.perf_counter()
                async with session.get(url + "/health") as response:
                    assert response.status == 200
                worst = max(worst, time.perf_counter() - start)
                await asyncio.sleep(0.02)

    probing = asyncio.ensure_future(probe())
    await asyncio.sleep(0.05)
    try:
        result = await attack
    finally:
        done.set()
        await probing
    return result, worst


def _nested(depth: int) -> msgspec.Raw:
    """JSON arrays `depth` deep around a 1, as raw text (json.dumps itself cannot nest that deep)."""
    return msgspec.Raw(b"[" * depth + b"1" + b"]" * depth)


# ---- memory (item 3): first, so that what it measures is the server's own, not other tests' ----


def _filled(make) -> bytes:
    """The largest body `make(k)` (k repeated units) within the limit."""
    base, unit = len(json.dumps(make(1))), len(json.dumps(make(2))) - len(json.dumps(make(1)))
    return json.dumps(make(1 + (BODY_LIMIT - base) // unit)).encode()


def _maximal_bodies() -> list[bytes]:
    """Bodies at the limit, one of each kind that costs memory: text, segments, token ids, a
    thousand-fold `Any` field, a chat message."""
    return [_filled(make) for make in (
        lambda k: {"prompt": "y " * k},
        lambda k: {"segments": ["z" * k] * 250},
        lambda k: {"prompt": [7] * k},
        lambda k: {"messages": CHAT, "tools": [{"a": [1]}] * k},
        lambda k: {"messages": [{"role": "user", "content": "w " * k}]},
    )]


def test_memory_after_bursts_of_maximal_bodies_is_given_back(server) -> None:
    """Every kind of maximal body, five at once, in rounds: resident memory after each round stays
    within the memory after the first (which sizes the heaps and worker threads) + 2 x the body limit."""
    bodies = _maximal_bodies()
    assert all(BODY_LIMIT - 1000 < len(body) <= BODY_LIMIT for body in bodies)
    paths = ["/v1/completions"] * 3 + ["/v1/chat/completions"] * 2

    async def rounds(count: int) -> list[tuple[list[int], int]]:
        after = []
        for _ in range(count):
            answers = await asyncio.gather(*(_post(server.url + p, b) for p, b in zip(paths, bodies)))
            after.append(([status for status, _, _ in answers], server.rss()))  # trimmed before each answer
        return after

    after = asyncio.run(rounds(3))
    assert all(400 <= status < 500 for statuses, _ in after for status in statuses), after
    start = after[0][1]
    assert all(rss <= start + 2 * BODY_LIMIT for _, rss in after[1:]), [rss >> 20 for _, rss in after]


# ---- bodies (issue 23, item 1) ---------------------------------------------------------------


@pytest.mark.parametrize(("field", "body"), [
    ("chat_template_kwargs", {"messages": CHAT, "chat_template_kwargs": {"x": _nested(1000)}}),
    ("tools", {"messages": CHAT, "tools": _nested(1000)}),
    ("response_format", {"messages": CHAT, "response_format": {"type": _nested(1000)}}),
    ("messages", {"messages": [{"role": "user", "content": "hi", "tool_calls": _nested(1000)}]}),
])
def test_deep_nesting_in_any_field_is_a_400_naming_it(server, field, body) -> None:
    error = assert_error(*post(server, "/v1/chat/completions", body)[:2], 400, field)
    assert "64 levels" in error["message"]


def test_nesting_at_the_limit_is_served(server) -> None:
    """64 levels, the body's own object included, pass the depth check."""
    body = {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"x": _nested(62)}}
    status, parsed, _ = post(server, "/v1/chat/completions", body)
    assert status == 200, parsed


@pytest.mark.parametrize("key", ["9" * 5000, "0" * 4999 + "1", "1" * 11])
def test_logit_bias_keys_too_long_for_a_token_id_are_a_400(server, key) -> None:
    error = assert_error(*post(server, "/v1/completions", {**NORMAL, "logit_bias": {key: 1.0}})[:2], 400, "logit_bias")
    assert len(error["message"]) < 200  # the key is not echoed in full


# ---- cost of one request (items 2 and 4) -----------------------------------------------------


def test_a_body_over_the_limit_is_a_413(server) -> None:
    body = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    assert_error(*post(server, "/v1/completions", body)[:2], 413)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "word " * 700_000, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"segments": ["word " * 3500] * 200, "max_tokens": 1}, "segments"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 700_000}]}, "messages"),
    ("/tokenize", {"prompt": "word " * 700_000}, "prompt"),
    ("/v1/completions", {"prompt": list(range(10, 10 + 400_000)), "max_tokens": 1}, "prompt"),
])
def test_a_prompt_that_cannot_fit_is_refused_at_once_while_others_are_served(server, path, body, param) -> None:
    """3.5 MB of text against a 512-token context: refused without tokenizing it, so the refusal
    and a normal client's request both come back within a second."""
    async def attack_and_normal():
        start = time.perf_counter()
        refused, normal = await asyncio.gather(_post(server.url + path, body),
                                               _post(server.url + "/v1/completions", NORMAL))
        return refused, normal, time.perf_counter() - start

    (refused, normal, elapsed), worst = asyncio.run(_health_while(server.url, attack_and_normal()))
    assert_error(*refused[:2], 400, param)
    assert normal[0] == 200 and normal[1]["usage"]["completion_tokens"] == 2
    assert elapsed < 3.0 and worst < 1.0, (elapsed, worst)


def test_segments_over_the_limit_are_refused_before_tokenizing(server) -> None:
    error = assert_error(*post(server, "/v1/completions", {"segments": ["a"] * 100_000})[:2], 400, "segments")
    assert "max_segments" in error["message"]


def test_prompts_times_n_over_the_cap_is_a_400(server) -> None:
    body = {"prompt": ["hello"] * 100, "n": 128, "max_tokens": 16}
    error = assert_error(*post(server, "/v1/completions", body)[:2], 400, "n")
    assert "12800" in error["message"] and str(MAX_SEQUENCES) in error["message"]


def test_a_refused_batch_leaves_no_spurious_503(server) -> None:
    """A batch under the per-request cap but over --max-waiting is refused whole (503); the aborts
    of its admitted prompts are not waiting requests, so the next request is served."""
    batch = {"prompt": ["hi"] * (MAX_WAITING + 36), "max_tokens": 1}

    async def refused_then_normal():
        refused = await _post(server.url + "/v1/completions", batch)
        return refused, await _post(server.url + "/v1/completions", NORMAL)

    refused, normal = asyncio.run(refused_then_normal())
    assert_error(*refused[:2], 503)
    assert int(refused[2]["Retry-After"]) >= 1
    assert normal[0] == 200, normal[1]


# ---- connections (item 9) --------------------------------------------------------------------


def _host_port(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _lifetime(sock: socket.socket, *, trickle: bool, limit: float) -> float | None:
    """Seconds until the server closed `sock`, sending a header byte every 100 ms if `trickle`
    (None if it was still open after `limit`)."""
    start = time.monotonic()
    sock.settimeout(0.1)
    while (elapsed := time.monotonic() - start) < limit:
        try:
            if trickle:
                sock.send(b"X")
            if sock.recv(4096) == b"":
                return elapsed
        except TimeoutError:
            continue
        except OSError:
            return elapsed
    return None


def test_idle_and_slowloris_sockets_are_closed_after_the_header_timeout(server) -> None:
    idle = socket.create_connection(_host_port(server))
    slow = socket.create_connection(_host_port(server))
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    with ThreadPoolExecutor(2) as pool:
        lifetimes = list(pool.map(lambda args: _lifetime(*args[:1], trickle=args[1], limit=HEADER_TIMEOUT + 3),
                                  [(idle, False), (slow, True)]))
    idle.close(), slow.close()
    assert all(t is not None and HEADER_TIMEOUT - 0.2 <= t <= HEADER_TIMEOUT + 1.5 for t in lifetimes), lifetimes


def test_connections_past_the_cap_get_503_and_the_server_stays_up(server) -> None:
    sockets = [socket.create_connection(_host_port(server)) for _ in range(MAX_CONNECTIONS + 4)]
    try:
        refused = 0
        for sock in sockets[MAX_CONNECTIONS:]:
            sock.settimeout(1.0)
            refused += sock.recv(100).startswith(b"HTTP/1.1 503")
        assert refused == 4
    finally:
        for sock in sockets:
            sock.close()
    deadline = time.monotonic() + 3.0  # the server counts a connection gone once it has seen it close
    while (status := post(server, "/v1/completions", NORMAL)[0]) == 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200


def test_a_nul_in_the_api_key_is_a_400_and_never_logged(server) -> None:
    with socket.create_connection(_host_port(server)) as sock:
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\x00x\r\n\r\n".encode())
        sock.settimeout(5.0)
        assert re.match(rb"HTTP/1\.[01] 400 ", sock.recv(100))
    time.sleep(0.2)  # the server writes its log line after answering
    log = server.log.read_text(errors="replace")
    assert "Invalid header value" in log and KEY not in log


# ---- property-based fuzz of bodies -----------------------------------------------------------

_HUGE_INTS = st.integers(min_value=10**18, max_value=10**400) | st.integers(max_value=-(10**18)).map(int)
_LEAF = st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=8) | _HUGE_INTS
_DEEP = st.integers(50, 3000).map(_nested)
_VALUE = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3), max_leaves=8)
_HOSTILE = _VALUE | _DEEP | st.integers(10_000, 600_000).map(lambda size: "ab " * size) | _HUGE_INTS
_FIELDS = ["prompt", "segments", "messages", "n", "max_tokens", "logit_bias", "seed", "temperature", "stop",
           "chat_template_kwargs", "tools", "response_format", "stream", "cache_salt", "bogus"]
_BODIES = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
    st.dictionaries(st.sampled_from(_FIELDS), _HOSTILE, max_size=3),
    st.sampled_from([{"prompt": "hi", "max_tokens": 1}, {"messages": CHAT, "max_tokens": 1}, {}]),
)


@settings(max_examples=40, deadline=None, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(case=_BODIES)
def test_fuzzed_hostile_bodies_get_2xx_or_well_formed_4xx(server, case) -> None:
    path, hostile, base = case
    (status, parsed, _), worst = asyncio.run(_health_while(server.url, _post(server.url + path, {**base, **hostile})))
    assert status < 500, parsed
    if status >= 400:
        assert_error(status, parsed, status)
    assert worst < 1.0


# ---- draining (item 6): last, it stops the server --------------------------------------------


def test_draining_503_carries_retry_after(server) -> None:
    async def sigterm_mid_stream() -> tuple[int, dict, str]:
        body = {**NORMAL, "max_tokens": 150, "stream": True}  # still in flight when the late request comes
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(server.url + "/v1/completions", json=body) as running:
                await running.content.readline()
                server.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while True:  # until the server has begun draining
                    async with session.get(server.url + "/health") as health:
                        if health.status == 503 or time.monotonic() > deadline:
                            break
                    await asyncio.sleep(0.02)
                late = await _post(server.url + "/v1/completions", NORMAL)
                rest = (await running.read()).decode()
        return late[0], late[2], rest

    status, headers, rest = asyncio.run(sigterm_mid_stream())
    assert status == 503 and int(headers["Retry-After"]) == GRACE_S
    assert rest.endswith("data: [DONE]\n\n")
    assert server.process.wait(timeout=30) == 0
