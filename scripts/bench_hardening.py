"""Hostile clients against `python -m hypic.serve` (CPU, bundled model): what a normal client sees
during each attack, the attack's own answer, and the server's memory after it.

Each case runs while a probe client asks /health every 50 ms and a one-token completion every
250 ms; a case records the attack's status and time, the probe's worst and median latency and its
503s (for /health and the completions apart), and the server's resident memory after the case. The server tree is chosen by --tree, so the same
script measures the commit before the hardening ("before") and after it ("after"); each run merges
its figures under its label into the JSON file:

    python scripts/bench_hardening.py --label before --tree /tmp/hypic-before
    python scripts/bench_hardening.py --label after --tree .
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from results import before_after_arguments, write_labelled_run

OUT = Path("bench/results/hardening_cpu_default_model.json")
API_KEY = "bench-secret-key-4711"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NORMAL = {"prompt": "Note: the code is 1234. Answer:", "max_tokens": 1}
SERVER_OPTIONS = ["--device", "cpu", "--port", "0", "--log-level", "info", "--max-waiting", "200",
                  "--api-key", API_KEY]


@dataclass
class Probe:
    """What the normal client saw, per kind of request ("health", "completion")."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {"health": [], "completion": []})
    statuses: dict[str, list[int]] = field(default_factory=lambda: {"health": [], "completion": []})

    def summary(self) -> dict:
        return {f"{kind}_{name}": value for kind in self.latencies for name, value in self._one(kind).items()}

    def _one(self, kind: str) -> dict:
        latencies, statuses = self.latencies[kind], self.statuses[kind]
        return {"requests": len(statuses), "503": statuses.count(503), "errors": sum(s >= 400 for s in statuses),
                "latency_max_s": round(max(latencies, default=0.0), 3),
                "latency_p50_s": round(statistics.median(latencies), 3) if latencies else 0.0}


async def _timed(probe: Probe, kind: str, session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> None:
    start = time.perf_counter()
    try:
        async with session.request(method, url, headers=AUTH, **kwargs) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        status = 599
    probe.latencies[kind].append(time.perf_counter() - start)
    probe.statuses[kind].append(status)


async def _probe(probe: Probe, url: str, stop: asyncio.Event) -> None:
    """A normal client: /health every 50 ms, a one-token completion every 250 ms, each in its own task."""
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tick = 0
        while not stop.is_set():
            tasks.append(asyncio.ensure_future(_timed(probe, "health", session, "GET", url + "/health")))
            if tick % 5 == 0:
                tasks.append(asyncio.ensure_future(
                    _timed(probe, "completion", session, "POST", url + "/v1/completions", json=NORMAL)))
            tick += 1
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)


async def _post(url: str, body: bytes, timeout: float = 600) -> int:
    headers = {**AUTH, "Content-Type": "application/json"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                return response.status
    except (aiohttp.ClientError, TimeoutError):
        return 599


def _nested(depth: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()[:-1] + (
        b', "chat_template_kwargs": {"x": ' + b"[" * depth + b"]" * depth + b"}}")


def _cases() -> dict[str, tuple[str, bytes]]:
    return {
        "deep_nesting_1000": ("/v1/chat/completions", _nested(1000)),
        "logit_bias_5000_digit_key": ("/v1/completions", json.dumps(
            {**NORMAL, "logit_bias": {"9" * 5000: 1.0}}).encode()),
        "prompt_5M_chars": ("/v1/completions", json.dumps({"prompt": "word " * 1_000_000, "max_tokens": 1}).encode()),
        "segments_100k": ("/v1/completions", json.dumps({"segments": ["a b"] * 100_000, "max_tokens": 1}).encode()),
        "body_20MB": ("/v1/completions", json.dumps({"prompt": "x y " * 5_000_000, "max_tokens": 1}).encode()),
        "amplification_100x128": ("/v1/completions", json.dumps(
            {"prompt": ["hello"] * 100, "n": 128, "max_tokens": 16, "ignore_eos": True}).encode()),
        "refused_batch_250": ("/v1/completions", json.dumps({"prompt": ["hi"] * 250, "max_tokens": 1}).encode()),
    }


def _rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) << 10


async def _case(url: str, pid: int, path: str, body: bytes, *, attack_timeout: float = 600) -> dict:
    probe, stop = Probe(), asyncio.Event()
    probing = asyncio.ensure_future(_probe(probe, url, stop))
    await asyncio.sleep(0.2)
    start = time.perf_counter()
    status = await _post(url + path, body, attack_timeout)
    elapsed = time.perf_counter() - start
    await asyncio.sleep(1.0)  # what clients see right after the attack counts too (spurious 503s)
    stop.set()
    await probing
    return {"attack_status": status, "attack_s": round(elapsed, 3), "body_bytes": len(body),
            **probe.summary(), "rss_after_bytes": _rss(pid)}


async def _slow_sockets(url: str, count: int, wait_s: float) -> dict:
    """`count` sockets that never finish their request head (half send nothing, half a byte a second)."""
    host, port = url.removeprefix("http://").split(":")
    sockets = [socket.create_connection((host, int(port))) for _ in range(count)]
    for index, sock in enumerate(sockets):
        sock.setblocking(False)
        if index % 2:
            sock.send(b"GET /health HTTP/1.1\r\n")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for sock in sockets[1::2]:
            _send_quietly(sock, b"X")
        await asyncio.sleep(1.0)
    still_open = sum(_is_open(sock) for sock in sockets)
    for sock in sockets:
        sock.close()
    return {"sockets": count, "still_open_after_s": wait_s, "still_open": still_open}


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)
    except OSError:
        pass


def _is_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


async def _nul_key(url: str, log_path: Path) -> dict:
    """A request whose Authorization header carries a NUL byte, sent raw; is the key in the log?"""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    secret = f"{API_KEY}\x00tail"
    writer.write(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {secret}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.read(200)
    writer.close()
    await asyncio.sleep(0.5)
    return {"status_line": head.split(b"\r\n", 1)[0].decode(errors="replace"),
            "key_in_log": API_KEY in log_path.read_text(errors="replace")}


async def _draining(url: str, process: subprocess.Popen) -> dict:
    """SIGTERM while a stream runs; a new request then gets 503: does it carry Retry-After?"""
    stream_body = {"prompt": "hello", "max_tokens": 64, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=stream_body, headers=AUTH) as running:
            await running.content.readline()
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with session.post(url + "/v1/completions", json=NORMAL, headers=AUTH) as late:
                await late.read()
                answer = {"status": late.status, "retry_after": late.headers.get("Retry-After")}
            await running.read()
    return answer


async def _run(tree: Path, log_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    with log_path.open("w") as log:  # cwd: `python -m` imports from the working directory first
        process = subprocess.Popen([sys.executable, "-m", "hypic.serve", *SERVER_OPTIONS], env=env, cwd=tree,
                                   stdout=subprocess.PIPE, stderr=log, text=True)
    line = process.stdout.readline()
    url = re.search(r"at (http://\S+) on", line).group(1)
    try:
        await _post(url + "/v1/completions", json.dumps(NORMAL).encode())  # warm-up
        results = {"rss_start_bytes": _rss(process.pid)}
        for name, (path, body) in _cases().items():
            # a client that waited 20 s for the amplified request gives up (its disconnect aborts it)
            timeout = 20.0 if name.startswith("amplification") else 600.0
            results[name] = await _case(url, process.pid, path, body, attack_timeout=timeout)
            print(name, results[name], flush=True)
        results["slow_sockets"] = await _slow_sockets(url, 40, 15.0)
        results["nul_in_authorization"] = await _nul_key(url, log_path)
        results["draining"] = await _draining(url, process)
        print({k: results[k] for k in ("slow_sockets", "nul_in_authorization", "draining")}, flush=True)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    return results



def main() -> None:
    args = before_after_arguments(__doc__, OUT)
    results = asyncio.run(_run(args.tree, Path(f"/tmp/bench_hardening_{args.label}.log")))
    write_labelled_run(args, "hardening", SERVER_OPTIONS, results)


if __name__ == "__main__":
    main()
