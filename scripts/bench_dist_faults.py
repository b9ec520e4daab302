"""Faults of a `python -m hypic.serve --workers 3` cluster (CPU, bundled model), before and after
issue 23 items 7 and 8:

- kill_mid_stream: a streamed completion (n = 2, greedy, penalties) whose generating worker is
  SIGKILLed once the first text arrived: did the stream complete, with the undisturbed run's text?
- huge_prompt: a 20 MB prompt (its worker tokenizes it for a long time, its event loop blocked)
  while a normal client asks for a one-token completion every 250 ms: the huge request's status,
  the normal client's latencies and 503s, and the hangs the router declared.

The server is built in this process as `python -m hypic.serve` builds it (the router's view tells
which worker generates the request and how many hangs it declared), from the tree --tree names, so
the same script measures the commit before the fixes and after them; each run merges its figures under its label into the JSON file:

    git archive main | tar -x -C /tmp/hypic-before && git rev-parse main > /tmp/hypic-before/COMMIT
    python scripts/bench_dist_faults.py --label before --tree /tmp/hypic-before
    python scripts/bench_dist_faults.py --label after --tree .
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from results import before_after_arguments, write_labelled_run

OUT = Path("bench/results/dist_faults_cpu_default_model.json")
SERVER_OPTIONS = ["--device", "cpu", "--port", "0", "--workers", "3", "--transport", "tcp"]
STREAMED = {"prompt": "Note: Linda Gruzeifei's locker code is 8355. Answer:", "n": 2, "max_tokens": 160,
            "temperature": 0, "ignore_eos": True, "frequency_penalty": 0.5, "presence_penalty": 0.3,
            "repetition_penalty": 1.2, "stream": True}
NORMAL = {"prompt": "Note: the code is 1234. Answer:", "max_tokens": 1}
HUGE_CHARS = 20 << 20


def generating_node(client) -> int:
    """The pid of the worker generating the one request running (the router charges it there)."""
    [node] = [n for n in client.cluster.nodes.values() if n.running]
    return client.nodes.pid(node.node_id)


async def stream(url: str, client=None) -> dict:
    """One streamed completion; with the cluster client, its generating worker is killed after the first text."""
    texts: dict[int, str] = {}
    killed_after = error = None
    start = time.perf_counter()
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=STREAMED) as response:
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"].get("message")
                continue
            for choice in event["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if client is not None and killed_after is None and any(texts.values()):
                killed_after = sum(map(len, texts.values()))
                os.kill(generating_node(client), signal.SIGKILL)
    return {"texts": texts, "chars": sum(map(len, texts.values())), "killed_after_chars": killed_after,
            "error": error, "seconds": round(time.perf_counter() - start, 3)}


async def kill_mid_stream(url: str, client) -> dict:
    undisturbed = await stream(url)
    killed = await stream(url, client)
    return {"completed": killed["error"] is None, "same_text_as_undisturbed": killed["texts"] == undisturbed["texts"],
            "chars_undisturbed": undisturbed["chars"], "chars_streamed": killed["chars"],
            "killed_after_chars": killed["killed_after_chars"], "error": killed["error"],
            "seconds_undisturbed": undisturbed["seconds"], "seconds_killed": killed["seconds"]}


async def timed_post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        status = 599
    return status, time.perf_counter() - start


async def huge_prompt(url: str, client) -> dict:
    huge = {"prompt": "lantern copper meadow " * (HUGE_CHARS // 22), "max_tokens": 1}
    hangs_before = client.stats().dist.node_hangs
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        attack = asyncio.ensure_future(timed_post(session, url, huge))
        probes = []
        while not attack.done():
            probes.append(asyncio.ensure_future(timed_post(session, url, NORMAL)))
            await asyncio.sleep(0.25)
        results = await asyncio.gather(*probes)
        status, seconds = attack.result()
    latencies = [s for _, s in results]
    return {"status": status, "seconds": round(seconds, 3), "probe_requests": len(results),
            "probe_503": sum(code == 503 for code, _ in results), "probe_errors": sum(code >= 400 for code, _ in results),
            "probe_latency_max_s": round(max(latencies, default=0.0), 3),
            "probe_latency_p50_s": round(statistics.median(latencies), 3) if latencies else 0.0,
            "node_hangs": client.stats().dist.node_hangs - hangs_before}


async def run() -> dict:
    """The server `python -m hypic.serve SERVER_OPTIONS` builds, in this process (the test needs
    the router's view: which worker generates the request, how many hangs it declared)."""
    from aiohttp import web

    from hypic.serve.app import build_app, runner_for
    from hypic.serve.args import add_serve_arguments, engine_config, server_settings
    from hypic.serve.server import engine_client

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(SERVER_OPTIONS)
    settings = server_settings(args)
    client = engine_client(engine_config(args), settings)
    await client.start()
    runner = runner_for(build_app(client, settings), access_log=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        results = {"kill_mid_stream": await kill_mid_stream(url, client)}
        print("kill_mid_stream", results["kill_mid_stream"], flush=True)
        await client.cluster.wait_until(lambda c: len(c.usable()) == 3, 300)  # the killed worker is back
        results["huge_prompt"] = await huge_prompt(url, client)
        print("huge_prompt", results["huge_prompt"], flush=True)
    finally:
        await runner.cleanup()
        await client.shutdown(0.0)
    return results



def main() -> None:
    args = before_after_arguments(__doc__, OUT)
    sys.path.insert(0, str(args.tree.resolve()))  # the engine workers, spawned, inherit this path
    results = asyncio.run(run())
    write_labelled_run(args, "dist_faults", SERVER_OPTIONS, results)


if __name__ == "__main__":
    main()
