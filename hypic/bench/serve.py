"""`hypic bench serve`: drive an OpenAI-compatible server with RAG, chat or traced traffic over a
sweep of request rates; print and save per-rate statistics, the sustainable rate and plots.

    hypic bench serve --request-rate 0.5,1,2,inf --out bench/results/bench_serve_cpu_default_model.json
    hypic bench serve --url http://127.0.0.1:8000 --cache-modes none,prefix,hypic --preheat ...
    hypic bench serve --url http://vllm:8000 --backend openai --tokenizer MODEL_DIR ...
    hypic bench serve --url ... --trace requests.jsonl
    hypic bench serve ... --cache-modes hypic --out R.json; hypic bench serve ... --cache-modes none --merge --out R.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import itertools
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

import aiohttp

from hypic.bench import arrivals, client, report, stats
from hypic.bench.workloads import BenchRequest, ChatSpec, ChatWorkload, RagSpec, RagWorkload, TraceWorkload
from hypic.engine.setup import BUNDLED_MODEL
from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import HypicError

Workload = RagWorkload | ChatWorkload | TraceWorkload
PREHEAT_CONCURRENCY = 8
CLIENT_KEEPALIVE_S = 4.0  # seconds a client keeps an idle connection for reuse
DEFAULT_SERVER = f"{shlex.quote(sys.executable)} -m hypic.serve --log-level warning"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    _target_arguments(parser.add_argument_group("server"))
    _workload_arguments(parser.add_argument_group("workload"))
    _load_arguments(parser.add_argument_group("load and SLO"))
    group = parser.add_argument_group("output")
    group.add_argument("--out", type=Path, help="JSON path; the PNG goes beside it "
                       "(default: bench/results/bench_serve_<device>_<model>.json)")
    group.add_argument("--merge", action="store_true",
                       help="add this run's series (or its rates of a series) to --out and keep the others; "
                            "refused when the file's workload, SLO or server differ")
    group.add_argument("--label", help="series name when --cache-modes is not given (default: the backend)")
    group.add_argument("--no-plot", action="store_true", help="no PNG (matplotlib not needed)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar (tqdm not needed)")


def _target_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--url", help="a running server; without it one is started with --server-command")
    group.add_argument("--server-command", default=DEFAULT_SERVER,
                       help="command starting a hypic server (--port 0 is appended; default: %(default)s)")
    group.add_argument("--backend", choices=("hypic", "openai"), default="hypic",
                       help="hypic: prompts as segments, cache_mode per request; openai: one prompt (vLLM, SGLang, ...)")
    group.add_argument("--model", help="model id to send (default: the server's first in /v1/models)")
    group.add_argument("--api-key", default=os.environ.get("HYPIC_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                       help="sent as Authorization: Bearer (default: $HYPIC_API_KEY or $OPENAI_API_KEY)")
    group.add_argument("--tokenizer", type=Path, default=BUNDLED_MODEL,
                       help="model directory with tokenizer.json (default: the bundled model)")
    group.add_argument("--prompt-form", choices=("ids", "text"), default="ids",
                       help="send token ids (the same tokens to every server) or text (default: %(default)s)")
    group.add_argument("--cache-modes", type=_names, help="hypic: one series per cache mode, e.g. none,prefix,hypic; "
                       "the server's caches are flushed before each")
    group.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (answers may end early)")
    group.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take (default: %(default)s)")


def _workload_arguments(group: argparse._ArgumentGroup) -> None:
    rag, chat = RagSpec(), ChatSpec()
    group.add_argument("--workload", choices=("rag", "chat"), default="rag", help="(default: %(default)s)")
    group.add_argument("--trace", type=Path, help="replay a JSONL trace (timestamp, segments or messages, max_tokens)")
    group.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    group.add_argument("--max-tokens", type=int, default=rag.max_tokens, help="output tokens (default: %(default)s)")
    group.add_argument("--documents", type=int, default=rag.documents, help="rag: corpus size (default: %(default)s)")
    group.add_argument("--doc-tokens", type=int, default=rag.doc_tokens, help="rag: mean document length (default: %(default)s)")
    group.add_argument("--doc-tokens-range", type=float, default=rag.doc_tokens_range,
                       help="rag: lengths uniform in mean·(1 ± this) (default: %(default)s)")
    group.add_argument("--docs-per-request", type=int, default=rag.docs_per_request, help="rag: k (default: %(default)s)")
    group.add_argument("--zipf-s", type=float, default=rag.zipf_s, help="rag: popularity exponent (default: %(default)s)")
    group.add_argument("--system-tokens", type=int, default=rag.system_tokens, help="(default: %(default)s)")
    group.add_argument("--question-tokens", type=int, default=rag.question_tokens, help="rag (default: %(default)s)")
    group.add_argument("--cold-fraction", type=float, default=rag.cold_fraction,
                       help="rag: each document is a new one with this probability (default: %(default)s)")
    group.add_argument("--preheat", action="store_true", help="rag: send every document once before each series")
    group.add_argument("--conversations", type=int, default=chat.conversations, help="chat: in flight (default: %(default)s)")
    group.add_argument("--turns", type=int, default=chat.turns, help="chat: per conversation (default: %(default)s)")
    group.add_argument("--user-tokens", type=int, default=chat.user_tokens, help="chat (default: %(default)s)")
    group.add_argument("--answer-tokens", type=int, default=chat.answer_tokens,
                       help="chat: a synthetic earlier answer's length (default: %(default)s)")


def _load_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--request-rate", type=_rates,
                       help="req/s, a comma list sweeps them, inf = all at once (default: inf; a trace: its timestamps)")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson (default: %(default)s)")
    group.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    group.add_argument("--num-requests", type=int, default=100, help="requests per rate (default: %(default)s)")
    group.add_argument("--duration", type=float, help="seconds: a point also ends after this long of arrivals "
                       "(rate x this many requests, if fewer than --num-requests)")
    group.add_argument("--warmup", type=int, default=0, help="requests sent at once first, not measured (default: %(default)s)")
    group.add_argument("--slo-ttft", type=float, default=1.0, help="seconds: p50 TTFT of a sustainable rate (default: %(default)s)")
    group.add_argument("--slo-tpot", type=float, help="seconds: each good request's TPOT bound in goodput")
    group.add_argument("--keep-up", type=float, default=0.9,
                       help="a sustainable rate completes this fraction of the offered one (default: %(default)s)")


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _rates(text: str) -> list[float]:
    try:
        rates = [float(item) for item in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rates are numbers or inf, comma-separated; got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"request rates must be positive; got {text!r}")
    return sorted(rates)


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    """`argv` is recorded in the results (an --api-key value masked)."""
    try:
        workload, results = checked_setup(args)
        with started_server(args) as (url, startup):
            run = {**report.run_record(["hypic", *argv]), "startup_line": startup}
            asyncio.run(run_sweeps(url, workload, args, run, functools.partial(report.sweep_update, results)))
    except HypicError as error:
        print(f"hypic bench serve: {error}", file=sys.stderr)
        return 2
    for one in results.data["series"]:
        print(report.summary_line(one, args.slo_ttft))
    print(f"wrote {results.path}")
    return 0


def checked_setup(args: argparse.Namespace) -> tuple[Workload, report.ResultFile]:
    """The workload and the result file, once every check that needs no server has passed (a
    merge's settings included: the model is checked once the server names it)."""
    if args.cache_modes and args.backend != "hypic":
        raise HypicError("--cache-modes needs --backend hypic (other servers have no per-request cache mode)")
    if args.merge and args.out is None:
        raise HypicError("--merge needs --out, the result file to merge into")
    if not args.no_progress:
        report.require("tqdm", "the progress bar", "--no-progress")
    if not args.no_plot:
        report.require("matplotlib", "the PNG plots", "--no-plot")
    workload = build_workload(Tokenizer.from_dir(args.tokenizer), args)
    written = None if args.no_plot else report.plotted
    results = report.ResultFile(args.out, sweep_header(workload, args, None), report.merged_series,
                                merging=args.merge, written=written)
    return workload, results


def build_workload(tokenizer: Tokenizer, args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        return TraceWorkload(tokenizer, args.trace)
    if args.workload == "chat":
        return ChatWorkload(tokenizer, ChatSpec(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                                                args.answer_tokens, args.max_tokens, args.seed))
    return RagWorkload(tokenizer, RagSpec(args.documents, args.doc_tokens, args.doc_tokens_range, args.docs_per_request,
                                          args.zipf_s, args.system_tokens, args.question_tokens, args.max_tokens,
                                          args.seed, args.cold_fraction))


@contextlib.contextmanager
def started_server(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """The server under test and its start-up line: --url as given (no line), or one started with
    --server-command on a free port and stopped (SIGTERM) at the end."""
    if args.url is not None:
        yield args.url.rstrip("/"), None
        return
    process = subprocess.Popen([*shlex.split(args.server_command), "--port", "0"], stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.search(r" at (http://\S+) on ", line)
    if match is None:
        process.kill()
        raise SystemExit(f"hypic bench serve: the server did not start (exit {process.wait()}): {line!r}")
    threading.Thread(target=process.stdout.read, daemon=True).start()  # a full pipe would block the server
    try:
        yield match.group(1), line.strip()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def slo_of(args: argparse.Namespace) -> stats.Slo:
    return stats.Slo(args.slo_ttft, args.slo_tpot, args.keep_up)


async def run_sweeps(url: str, workload: Workload, args: argparse.Namespace, run: dict,
                     on_update: Callable[[dict], object] = lambda result: None) -> dict:
    """Warm-up, then for each series (cache mode): flush, preheat and the rate sweep. `run` (date,
    commit, command, ...) goes into every point; `on_update` gets the result once the server has
    named its model, before anything is measured, and again after every point."""
    slo = slo_of(args)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    # reuse a connection only while the server surely keeps it (uvicorn closes idle ones after 5 s, hypic after
    # its header timeout, 10 s): past that a request can race the server's close and read a reset (seen on the H200)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        base = client.Target(url, args.model or await first_model(session, url), args.backend, args.prompt_form,
                             ignore_eos=not args.no_ignore_eos)
        result = {**sweep_header(workload, args, base.model), **run, "series": []}
        on_update(result)
        if args.warmup:
            warm = [arrivals.Planned(i, 0.0, r) for i, r in enumerate(itertools.islice(workload.requests("warmup"), args.warmup))]
            await arrivals.dispatch(warm, lambda r: client.send(session, base, r), max_concurrency=args.max_concurrency)
        for mode in args.cache_modes or [None]:
            target = replace(base, cache_mode=mode)
            if mode is not None:
                await flush(session, url)
            if args.preheat:
                await preheat(session, target, workload)
            series = {"label": mode or args.label or args.backend, "cache_mode": mode, "points": []}
            result["series"].append(series)
            async for point in sweep(session, target, workload, args, slo, series["label"]):
                series["points"].append({**point, "run": {**run, "url": url}})
                series.update(report.series_figures(series["points"], slo))
                on_update(result)
    return result


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def flush(session: aiohttp.ClientSession, url: str) -> None:
    """Empty a hypic server's prefix cache and segment pool, so that no series inherits another's."""
    async with session.post(url + "/admin/cache/flush", json={}) as response:
        response.raise_for_status()


async def preheat(session: aiohttp.ClientSession, target: client.Target, workload: Workload) -> None:
    plan = [arrivals.Planned(i, 0.0, request) for i, request in enumerate(workload.preheat())]
    done = await arrivals.dispatch(plan, lambda r: client.send(session, target, r), max_concurrency=PREHEAT_CONCURRENCY)
    failed = [d.result.error for d in done if d.result.error]
    if failed:
        raise SystemExit(f"hypic bench serve: {len(failed)} preheat requests failed, e.g. {failed[0]}")


async def sweep(session: aiohttp.ClientSession, target: client.Target, workload: Workload,
                args: argparse.Namespace, slo: stats.Slo, label: str) -> AsyncIterator[dict]:
    """One point per rate, each printed (under the series' `label`) as it finishes. A rate's requests
    and arrival times are drawn from a stream of its own (seeded by --seed and the rate): every
    series, and a sweep split over several runs, sends the same requests at the same rate."""
    for rate in args.request_rate or [None if isinstance(workload, TraceWorkload) else float("inf")]:
        key = "trace" if rate is None else f"{rate:g}"
        plan = planned(enumerate(workload.requests(key)), rate, args, random.Random(f"{args.seed}/{key}"))
        dispatched = await dispatch_with_progress(session, target, plan, args, f"{label} @ {key}")
        point = stats.summarize(rate, dispatched, slo)
        print(f"{label}: {one_line(point)}", file=sys.stderr, flush=True)
        yield point


def planned(stream: Iterator[tuple[int, BenchRequest]], rate: float | None, args: argparse.Namespace,
            rng: random.Random) -> list[arrivals.Planned]:
    """The next requests of the stream with their arrival times (None: a trace's own timestamps)."""
    if rate is None:
        items = list(stream)
        first = min(request.arrival_s for _, request in items)
        return [arrivals.Planned(i, request.arrival_s - first, request) for i, request in items]
    bounded = args.duration and math.isfinite(rate)
    count = min(args.num_requests, math.ceil(rate * args.duration)) if bounded else args.num_requests
    items = list(itertools.islice(stream, count))
    times = arrivals.arrival_times(len(items), rate, args.burstiness, rng)
    return [arrivals.Planned(i, at, request) for (i, request), at in zip(items, times)]


async def dispatch_with_progress(session: aiohttp.ClientSession, target: client.Target,
                                 plan: list[arrivals.Planned], args: argparse.Namespace,
                                 label: str) -> list[arrivals.Dispatched[client.Outcome]]:
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(plan), desc=label, unit="req", leave=False)
    try:
        return await arrivals.dispatch(plan, lambda r: client.send(session, target, r),
                                       max_concurrency=args.max_concurrency,
                                       on_done=(lambda outcome: bar.update()) if bar else (lambda outcome: None))
    finally:
        if bar is not None:
            bar.close()


def one_line(point: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"
    return (f"rate {point['request_rate']:g} req/s: achieved {point['achieved_rps']:.2f}, TTFT p50/p99 "
            f"{ms(point['ttft_p50_s'])}/{ms(point['ttft_p99_s'])} ms, TPOT p50 {ms(point['tpot_p50_s'])} ms, "
            f"out {point['output_tokens_per_s']:.0f} tok/s, cached {point['cached_token_fraction'] or 0:.0%}, "
            f"errors {point['errors']}")


def sweep_header(workload: Workload, args: argparse.Namespace, model: str | None) -> dict:
    """The benchmark and its settings (report.SETTINGS): what runs merged into one file must share."""
    return {"benchmark": "bench_serve", "server": server_record(args, model),
            "workload": workload_record(workload, args), "slo": asdict(slo_of(args))}


def workload_record(workload: Workload, args: argparse.Namespace) -> dict:
    """What the requests were: runs merged into one file must agree on all of it."""
    kind = "trace" if isinstance(workload, TraceWorkload) else args.workload
    record = {"kind": kind, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "num_requests": args.num_requests, "duration_s": args.duration, "warmup": args.warmup,
              "preheat": args.preheat, "tokenizer_sha256": tokenizer_digest(args.tokenizer)}
    return {**record, **({"trace": str(args.trace)} if kind == "trace" else asdict(workload.spec))}


def tokenizer_digest(directory: Path) -> str:
    """The tokenizer's identity, wherever its directory is on this machine."""
    return hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()[:16]


def server_record(args: argparse.Namespace, model: str | None) -> dict:
    """What served the requests (the model once known): the command that started it, or None for --url."""
    record = {"backend": args.backend, "prompt_form": args.prompt_form,
              "command": args.server_command if args.url is None else None}
    return record if model is None else {**record, "model": model}


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("results", type=Path, nargs="+", help="JSON files of hypic bench serve")
    parser.add_argument("--title", default="", help="figure title")


def plot_from_args(args: argparse.Namespace) -> int:
    """One figure with every series of several runs (servers, or cache modes run one at a time)."""
    report.require("matplotlib", "hypic bench plot")
    series = report.read_series(args.results)
    report.plot(args.out, series, args.title, series[0]["slo_ttft_s"])
    for one in series:
        print(report.summary_line(one, one["slo_ttft_s"]))
    print(f"wrote {args.out}")
    return 0
