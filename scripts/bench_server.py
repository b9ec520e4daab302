"""Server throughput and latency: requests/s and p50/p99 TTFT for concurrent short chat requests.

Streams `--requests` chat completions (default 64, all at once) and measures, per request, the time
to the first content token (TTFT) and to the end. Writes JSON under bench/results/.

    python scripts/bench_server.py                                  # starts the bundled model (auto device)
    python scripts/bench_server.py --url http://127.0.0.1:8000      # against a running server
    python scripts/bench_server.py --shape qwen3_5_moe --device cuda  # H200: random weights, released shape
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from results import device_label, result_path, run_record

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("qwen3_5_moe", "qwen3_5", "qwen3_next")


@dataclass(frozen=True)
class Sample:
    ttft_s: float | None
    e2e_s: float
    completion_tokens: int
    error: str | None = None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; without it the script starts one")
    parser.add_argument("--requests", type=int, default=64, help="chat requests in all (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=64,
                        help="requests sent together first and not measured (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="device of a started server (default: %(default)s)")
    parser.add_argument("--shape", choices=SHAPES, help="serve random weights of this released shape (GPU)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="context of a started server (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="JSON path (default: bench/results/server_<device>_<model>.json)")
    parser.add_argument("--serve-shape", choices=SHAPES, help=argparse.SUPPRESS)  # the child process of --shape
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- load generation ---------------------------------------------------------------------------


async def one_chat(session: aiohttp.ClientSession, url: str, model: str, index: int, max_tokens: int) -> Sample:
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"Question {index}: what is {index} plus {index * 7}?"}],
    }
    start, ttft, tokens = time.perf_counter(), None, 0
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return Sample(None, time.perf_counter() - start, 0, f"{response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(choice["delta"].get("content") for choice in chunk["choices"]):
                ttft = time.perf_counter() - start
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return Sample(ttft, time.perf_counter() - start, tokens)


async def load(url: str, args: argparse.Namespace) -> tuple[list[Sample], float, str]:
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        # one unmeasured wave as wide as the measured one: kernels compile for its batch shapes
        await asyncio.gather(*(one_chat(session, url, model, -1 - index, args.max_tokens)
                               for index in range(args.warmup)))

        async def gated(index: int) -> Sample:
            async with gate:
                return await one_chat(session, url, model, index, args.max_tokens)

        start = time.perf_counter()
        samples = await asyncio.gather(*(gated(index) for index in range(args.requests)))
        return list(samples), time.perf_counter() - start, model


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(samples: list[Sample], wall_s: float) -> dict:
    good = [s for s in samples if s.error is None]
    ttfts = [s.ttft_s for s in good if s.ttft_s is not None]
    e2es = [s.e2e_s for s in good]
    return {
        "requests_per_s": len(good) / wall_s, "output_tokens_per_s": sum(s.completion_tokens for s in good) / wall_s,
        "wall_s": wall_s, "ok": len(good), "errors": [s.error for s in samples if s.error][:5],
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2es, 50), "e2e_p99_s": percentile(e2es, 99),
    }


# ---- the server under test ---------------------------------------------------------------------


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    """A server process on a free port; returns it, its URL and its start-up line."""
    common = ["--device", args.device, "--port", "0", "--max-model-len", str(args.max_model_len)]
    if args.shape:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve-shape", args.shape, *common]
    else:
        command = [sys.executable, "-m", "hypic.serve", "--log-level", "warning", *common]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.search(r"at (http://\S+) on", line)
    if match is None:
        process.kill()
        sys.exit(f"the server did not start (exit {process.wait()}); its output: {line!r}")
    return process, match.group(1), line.strip()


def serve_shape(args: argparse.Namespace) -> int:
    """Child process: serve random bf16 weights of a released shape with the bundled tokenizer."""
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from bench_engine import model_dir, random_weights, shape_config

    from hypic import EngineConfig
    from hypic.serve.server import run
    from hypic.serve.state import ServerSettings

    config = shape_config(args.serve_shape, args.max_model_len)
    engine = EngineConfig(model=str(model_dir(config)), device=args.device, max_model_len=args.max_model_len,
                          state_dict=random_weights(config, seed=0))
    return run(engine, ServerSettings(served_model_name=args.serve_shape), "127.0.0.1", args.port)


def device_of(startup: str | None) -> str:
    """The result's device label, from the started server's line ("... on cuda: ..."; it runs on this machine)."""
    found = re.search(r" on (\S+):", startup or "")
    if found is None:
        return "remote"
    if found.group(1).startswith("cuda"):
        import torch
        return device_label(torch.cuda.get_device_name())
    return "cpu"


def main() -> int:
    args = parse_args()
    if args.serve_shape:
        return serve_shape(args)
    process, url, startup = start_server(args) if args.url is None else (None, args.url.rstrip("/"), None)
    try:
        samples, wall_s, model = asyncio.run(load(url, args))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    result = {"benchmark": "server_chat", "model": model, "startup_line": startup, "requests": args.requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, **summary(samples, wall_s),
              **run_record()}
    out = args.out or result_path("server", device_of(startup), model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
