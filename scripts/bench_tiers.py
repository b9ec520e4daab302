"""Segment tiers on one GPU (issue 28), in parts that run and save on their own (--parts, default all):

  copy  the pinned host<->device copy rates (ttft's target needs them: ttft always runs copy too);
  ttft  TTFT of warm RAG prompts served from the GPU pool, from the host tier and by full recompute
        (`none`), each with the tier that served its tokens (`served_from`) and the issue's target;
  disk  the same prompt shapes served from disk by an engine restarted on a directory another
        engine wrote (its files dropped from the page cache), beside first-time (`cold`) prompts
        of each shape on that engine; each request traced;
  qps_host, qps_pool   a corpus ten times the GPU pool under a rate sweep of `hypic bench serve`,
        with the host tier and without it (pool only): the sustainable QPS of each (`qps` names both).

Prompt = a system prefix + n documents + a question, random tokens, on a released shape with random
bf16 weights (default: Qwen3.5-35B-A3B text, built once per process), a GPU pool of 4 GB and a host
tier of 40 GB. ttft: each measured request puts its documents in a new order, with a new question
(the prefix cache reuses only the system prompt); for a host-tier hit the same filler tuples are
imported until the pool has demoted every document. The target: a host hit costs at most the pool
hit + the entries' bytes / the copy rate + 3 ms, and at most 20 % of recompute at 4 x 4k. disk:
other document sets, cached and demoted (so written to disk) by a first engine (ttft's, when both
run), are served by a second one, which reads each from disk or recomputes it, whichever its
rates say is cheaper, and recomputes a read not done by its deadline (`rates_at_start`: the rates
it started from, kept beside the files by the first engine, the read rate probed if none was;
`disk_stats_after_restart`: the rates measured since, the counts read, recomputed and late). Its
host tier is pinned whole first (as qps's: pinning holds the CUDA driver's lock, so slabs pinned
while it serves would stall it). Then `cold`: prompts of each shape whose documents were never seen
(every segment prefilled cold), for reference. Every request of the part has a trace (`traces`):
its seconds waiting for disk reads, for promotion copies to land, and computing (cold segments
and its own prefill), its segments read, recomputed and late, and the pinned allocations made
meanwhile (a GPU). qps: the server runs in this process (engine thread, HTTP on this event loop), one
engine with the host tier and one without (same pool, same seeded requests, preheated with every
document), a part each; the host tier is pinned whole before its sweep (the time it took is printed). Each
engine is closed when its part is done: its pinned slabs go back to torch's pinned allocator, and
the next engine takes them from there instead of pinning anew.

Each figure is printed as soon as it is measured, each phase's start and end with its wall seconds,
and at the start of each part and engine the host's memory (MemAvailable, the pinned bytes torch
holds, the live host tiers' bytes). During the qps parts a watchdog prints every thread's stack when the
engine has requests but runs no step for STALL_S (at most MAX_STALL_DUMPS times a sweep).
The result is written after each part (a timeout keeps what was measured; hypic.bench.report's
ResultFile). The file lists each run (date, commit, command, the parts asked for and the wall seconds
of those measured) and each part under the run that measured it; a run of some parts replaces those
in an existing result file and keeps the others, so runs in several sessions build one file.

What each part costs on the H200: copy and ttft measured (`--parts copy,ttft`: 90 s with a warm
Triton cache), the rest estimated from the code. Before any part but copy: the weights, 8 s (the
shape's config through transformers, 70 GB of random bf16 made on the GPU, once per process). The
first engine of a process started in 14 s and its first prefill took 34 s (flash-linear-attention's
chunk kernels autotune); a later engine starts in ~15 s, ~7 s more with a disk tier (it hashes the
70 GB of weights for the directory's identity).
  copy  1 s (five 1 GiB copies each way).
  ttft  77 s: one engine (no disk tier unless disk runs too), then per prompt shape a cold
        prompt and 4 rounds (--repeats 3 + one unmeasured) of a pool hit, ~30 filler imports pushing
        the documents to the host tier, a host hit and a recompute: ~1 s a round.
  disk  ~1 min after ttft in the same process: ttft's engine (then with a disk tier) also prefills 4
        document sets per shape and writes ~15 GB, synced before the restart; the restarted engine
        pins its host tier whole (from torch's pinned cache as far as earlier engines filled it,
        the rest estimated 10-40 s), serves 4 prompts per shape from disk, then 4 cold ones
        (~0.5 s each), each followed by its disk writes. Alone ~3-4 min: an engine of its own
        writes the sets first.
  qps_host, qps_pool   an engine each: a start, a preheat of ~500 documents of 1k tokens (~15 s)
        and 6 rates x 48 requests (rate 1 alone takes 48 s; pool only saturates near 3 req/s, so
        each of its rates from 4 up takes ~16 s); before the host tier's sweep, the pinning of
        what earlier engines did not leave in torch's pinned cache (40 GiB of cudaHostAlloc:
        10-40 s). Both in one call took more than 7 minutes: run them in a call each.
So --parts copy,ttft ~2-3 min; disk ~3-4 min; qps_host or qps_pool ~3-4 min each.

    python scripts/bench_tiers.py --parts copy,ttft    # H200: bench/results/tiers_h200_qwen3_5_moe.json
    python scripts/bench_tiers.py --parts disk         # another call: merged into the same file
    python scripts/bench_tiers.py --parts qps_host     # then qps_pool, a call each
    python scripts/bench_tiers.py --device cpu         # smoke run: the bundled model, same code paths
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import faulthandler
import gc
import itertools
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import torch
from aiohttp import web
from bench_engine import model_dir, random_weights, shape_config
from bench_pic import QUERY_TOKENS, SYSTEM_TOKENS, rag_prompt, random_tokens, sync, timed_request
from results import device_label, group, grouped_result, phase, result_path, say

from hypic import EngineConfig
from hypic.bench.report import ResultFile, measured_by
from hypic.bench.serve import add_bench_arguments, build_workload, run_sweeps
from hypic.cache.segment_store import SegmentKey, SegmentLayout, SegmentTuple
from hypic.cache.tiers import HostArena
from hypic.engine.client import InProcessEngineClient
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.setup import BUNDLED_MODEL, resolve_dtype, resolve_segment_state_dtype
from hypic.engine.text.tokenizer import Tokenizer
from hypic.engine.sequence import Sequence
from hypic.models.config import read_config_json
from hypic.sampling_params import SamplingParams
from hypic.models.registry import architecture, load_config
from hypic.serve.app import build_app, runner_for
from hypic.serve.state import ServerSettings

PARTS = ("copy", "ttft", "disk", "qps_host", "qps_pool")  # in the order they run
QPS_PARTS = {"qps_host": "host tier", "qps_pool": "pool only"}  # `--parts qps` names both
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # copy: bytes per timed copy
TWENTY_PERCENT_AT = "4x4096"  # the prompt shape where the issue asks for a host hit within 20 % of recompute
TIERS = ("pool", "host", "none")  # measured by ttft; "disk" and "cold" by the disk part's restarted engine
TRACED = ("read_s", "copy_s", "compute_s")  # where a traced request's time went
IDLE_S = 5e-4  # a traced request's loop, when the engine had nothing to run: its reader threads get the GIL
STALL_S = 1.0  # qps: an engine with requests that runs no step this long is stalled
MAX_STALL_DUMPS = 3  # stacks printed per sweep, at most
SAMPLE_S = 0.02  # qps: how often the stall watch looks at the engine thread
PROFILE_LINES = 8  # the places it was most often, printed after each sweep
PINNED_FIGURES = ("reserved_bytes", "allocated_bytes", "active_bytes")  # of torch.cuda.host_memory_stats
# what differs between the H200 run and the CPU smoke run (the bundled model, ~1 MB per entry)
# qps on the H200: pool only saturates near 3 req/s and the host tier near 13 (4 x 1k prompts), so the
# sweep starts well below both; 48 requests a point keep the last request's latency a small part of it
DEVICE_DEFAULTS = {
    "cuda": dict(pool_bytes=4 << 30, host_bytes=40 << 30, disk_bytes=24 << 30, prompts="4x4096,16x1024",
                 qps_doc_tokens=1024, qps_docs_per_request=4, qps_rates="1,2,4,8,16,inf", qps_requests=48),
    "cpu": dict(pool_bytes=4 << 20, host_bytes=40 << 20, disk_bytes=256 << 20, prompts="2x128,4x32",
                qps_doc_tokens=32, qps_docs_per_request=2, qps_rates="20,inf", qps_requests=6),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--parts", type=parts_list, default=PARTS,
                        help="comma list of " + ",".join(PARTS) + " (qps: both qps parts)")
    parser.add_argument("--shape", default="qwen3_5_moe", help="cuda: the released shape (random bf16 weights)")
    parser.add_argument("--pool-bytes", type=int)
    parser.add_argument("--host-bytes", type=int)
    parser.add_argument("--disk-bytes", type=int)
    parser.add_argument("--disk-dir", type=Path, help="parent of the disk tier's directory (default: the temp dir)")
    parser.add_argument("--prompts", metavar="NxLEN,...", help="ttft, disk: prompt shapes")
    parser.add_argument("--repeats", type=int, default=3, help="ttft, disk: measured requests per tier and shape")
    parser.add_argument("--corpus-factor", type=float, default=10.0, help="qps: corpus bytes / GPU pool bytes")
    parser.add_argument("--qps-doc-tokens", type=int)
    parser.add_argument("--qps-docs-per-request", type=int)
    parser.add_argument("--qps-rates", help="qps: the rate sweep, req/s")
    parser.add_argument("--qps-requests", type=int, help="qps: requests per rate")
    parser.add_argument("--out", type=Path, help="default: bench/results/tiers_<device>_<shape>.json")
    args = parser.parse_args(argv)
    for name, value in DEVICE_DEFAULTS[args.device].items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    args.prompts = [tuple(map(int, shape.split("x"))) for shape in args.prompts.split(",")]
    return args


def parts_list(text: str) -> tuple[str, ...]:
    """The parts named, in run order; ttft brings copy (its target divides by the copy rate)."""
    named = {name for given in text.split(",") for name in (QPS_PARTS if given == "qps" else (given,))}
    if unknown := named - set(PARTS):
        raise argparse.ArgumentTypeError(f"unknown parts {sorted(unknown)}; the parts are {','.join(PARTS)}")
    return tuple(part for part in PARTS if part in named or (part == "copy" and "ttft" in named))


@contextlib.contextmanager
def part(record: ResultFile, name: str, settings: dict) -> Iterator[dict]:
    """A part: its figures (filled into the dict yielded) and settings, saved under parts[name] when it ends."""
    with group(record, name) as saved:
        host_memory(f"at the start of {name}")
        figures: dict = {}
        yield figures
        saved[("parts", name)] = {"settings": settings, **figures}


def host_memory(when: str) -> None:
    """What the host has left, what torch's pinned allocator holds (in tensors, or cached for the
    next engine) and what the live host tiers hold: an engine that outlived its part shows as a
    host tier too many."""
    arenas = [o for o in gc.get_objects() if type(o) is HostArena]  # type(): isinstance asks lazy modules for __class__
    say(f"host memory {when}: MemAvailable {mem_available() / 2**30:.1f} GiB, {pinned()}, {len(arenas)} live "
        f"host tiers holding {sum(a.allocated_bytes for a in arenas) / 2**30:.1f} GiB")


def mem_available() -> int:
    lines = Path("/proc/meminfo").read_text().splitlines()
    return next(int(line.split()[1]) << 10 for line in lines if line.startswith("MemAvailable:"))


def pinned() -> str:
    """torch's pinned-memory figures under their own names (their meaning moved between torch
    versions: `reserved_bytes` or `allocated_bytes` counts what the allocator holds, cached
    included); a torch without them, or without CUDA, says so."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return "pinned bytes not reported"
    s = stats()
    sizes = ", ".join(f"{name} {s[name + '.current'] / 2**30:.1f} GiB" for name in PINNED_FIGURES
                      if name + ".current" in s)
    took, longest = s.get("host_alloc_time.total", 0) / 1e6, s.get("host_alloc_time.max", 0) / 1e3
    allocations = s.get("num_host_alloc", 0)
    return f"pinned ({sizes}; {allocations} host allocations took {took:.1f} s, the longest {longest:.0f} ms)"


class StallWatch:
    """While a sweep runs: when the engine has requests but runs no step for STALL_S, every
    thread's stack (and the host's memory), once a stall and at most MAX_STALL_DUMPS times; at the
    end, its steps a second while it had requests, its stalls and the longest (a slow engine and a
    stalled one read differently), and where its thread was, sampled every SAMPLE_S (a profile of
    the engine thread: waiting on the device, on a lock, or working on the host)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.busy_s, self.busy_steps, self.stalls, self.longest_s = 0.0, 0, 0, 0.0
        self.samples: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-stall-watch", daemon=True)

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        say(f"stall watch: {self.busy_steps} steps in {self.busy_s:.1f} s with requests in "
            f"({self.busy_steps / max(self.busy_s, 1e-9):.1f} a second), {self.stalls} stalls of over "
            f"{STALL_S:g} s, the longest {self.longest_s:.1f} s; the engine thread, in "
            f"{sum(self.samples.values())} samples:")
        for where, count in self.samples.most_common(PROFILE_LINES):
            say(f"  {count / sum(self.samples.values()):6.1%}  {where}")

    def _watch(self) -> None:
        engine_thread = next((t.ident for t in threading.enumerate() if t.name == "hypic-engine"), None)
        steps, last, since, stalled = self.engine.steps, time.monotonic(), time.monotonic(), False
        while not self._stop.wait(SAMPLE_S):
            now, count, busy = time.monotonic(), self.engine.steps, bool(self.engine.requests)
            if busy:
                self.busy_s, self.busy_steps = self.busy_s + now - last, self.busy_steps + count - steps
                self._sample(engine_thread)
            last = now
            if count != steps or not busy:
                steps, since, stalled = count, now, False
            elif now - since > STALL_S:
                self.longest_s = max(self.longest_s, now - since)
                if not stalled:
                    stalled = True
                    self._stalled(now - since)

    def _sample(self, engine_thread: int | None) -> None:
        frame = sys._current_frames().get(engine_thread)
        if frame is not None:
            self.samples[frame_line(frame)] += 1

    def _stalled(self, seconds: float) -> None:
        self.stalls += 1
        if self.stalls > MAX_STALL_DUMPS:
            return
        say(f"engine stall {self.stalls} (stacks printed for the first {MAX_STALL_DUMPS}): no step for "
            f"{seconds:.1f} s with {len(self.engine.requests)} requests in; every thread's stack:")
        faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
        host_memory("at the stall")


def frame_line(frame) -> str:
    """A stack's innermost frame, and the innermost of hypic's under it (where the call came from)."""
    def named(f) -> str:
        return f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
    ours = frame
    while ours is not None and f"{os.sep}hypic{os.sep}" not in ours.f_code.co_filename:
        ours = ours.f_back
    return named(frame) if ours is None or ours is frame else f"{named(frame)} <- {named(ours)}"


def in_run_order(data: dict) -> None:
    """The file keeps its parts in run order whatever order the runs wrote them."""
    data["parts"] = {name: data["parts"][name] for name in PARTS if name in data.get("parts", {})}


# -- copy -----------------------------------------------------------------------------------------

def copy_rates(device: torch.device, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median bytes/s of host -> device and device -> host copies of `nbytes` (pinned host memory
    on a GPU)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, dst, src in (("host_to_device", on_device, host), ("device_to_host", host, on_device)):
        rates[name] = nbytes / statistics.median_high(timed_copy(dst, src) for _ in range(repeats))
        say(f"copy {name}: {rates[name] / 1e9:.2f} GB/s (median of {repeats} copies of {nbytes / 2**20:.0f} MiB)")
    return rates


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    if dst.device.type != "cuda" and src.device.type != "cuda":
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# -- ttft and disk --------------------------------------------------------------------------------

@dataclasses.dataclass
class PromptShape:
    """One prompt shape's documents: `warm` for the pool and host figures, `disk` sets (one per
    request) that only the restarted engine serves."""

    name: str
    system: tuple[int, ...]
    warm: list[tuple[int, ...]]
    disk: list[list[tuple[int, ...]]]

    @classmethod
    def random(cls, num_docs: int, doc_len: int, sets: int, rng: random.Random) -> PromptShape:
        def docs() -> list[tuple[int, ...]]:
            return [random_tokens(doc_len, rng) for _ in range(num_docs)]
        return cls(f"{num_docs}x{doc_len}", random_tokens(SYSTEM_TOKENS, rng), docs(), [docs() for _ in range(sets)])

    def prompt(self, docs: list[tuple[int, ...]], rng: random.Random):
        """The documents in a new order, with a new question."""
        return rag_prompt(rng.sample(docs, len(docs)), self.system, random_tokens(QUERY_TOKENS, rng))

    def fresh(self, rng: random.Random) -> list[tuple[int, ...]]:
        """Documents of the shape never seen before."""
        return [random_tokens(len(doc), rng) for doc in self.warm]


class Timings:
    """Per tier: the measured TTFTs and the cached tokens by kind of those requests."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.kinds: dict[str, dict[str, int]] = {}

    def add(self, tier: str, measured: tuple[float, dict[str, int]]) -> None:
        self.seconds.setdefault(tier, []).append(measured[0])
        kinds = self.kinds.setdefault(tier, {})
        for kind, tokens in measured[1].items():
            kinds[kind] = kinds.get(kind, 0) + tokens

    def medians(self, shape: str) -> dict:
        """Each tier's median, printed."""
        medians = {tier: statistics.median_high(t) for tier, t in self.seconds.items()}
        for tier, seconds in medians.items():
            say(f"{shape:>8} {tier:>4}: TTFT {seconds * 1e3:8.1f} ms (median of {len(self.seconds[tier])}), "
                f"served_from {self.kinds[tier]}")
        return {**medians, "served_from": self.kinds}


def random_tuple(engine: LLMEngine, interior_len: int) -> SegmentTuple:
    lay, dev = engine.store.layout, engine.device
    lin, kv = range(lay.num_linear), (interior_len, lay.kv_heads, lay.head_dim)
    rand = lambda shape, dtype: torch.randn(shape, device=dev).to(dtype)  # noqa: E731
    return SegmentTuple((0, interior_len), [rand(lay.t_shape(i), lay.t_dtype(i)) for i in lin],
                        [rand(lay.s0_shape(i), lay.state_dtype) for i in lin],
                        [rand(lay.conv_shape(i), lay.model_dtype) for i in lin],
                        [rand(kv, lay.model_dtype)] * lay.num_full, [rand(kv, lay.model_dtype)] * lay.num_full)


def fillers(engine: LLMEngine, interior_len: int, rng: random.Random) -> list[tuple[SegmentKey, SegmentTuple]]:
    """More than a pool's worth of keys for one random tuple: the same ones push out every time, so
    each is demoted (and written to disk) once, not once per measurement."""
    tup = random_tuple(engine, interior_len)
    count = engine.store.capacity_bytes // engine.store.layout.entry_bytes(interior_len) + 2
    return [(SegmentKey(rng.randbytes(16), "filler"), tup) for _ in range(count)]


def push_out(engine: LLMEngine, keys: list[SegmentKey], filler: list[tuple[SegmentKey, SegmentTuple]]) -> None:
    """Import fillers until no key of `keys` is in the pool (demoted, not dropped). Each import's
    copies, disk writes and host slab pinning land before the next (faster than pinning, demotions
    would evict below instead), so nothing of this runs beside the measured request."""
    for key, tup in itertools.islice(itertools.cycle(filler), 4 * len(filler)):
        if all(engine.store.tier(k) != "pool" for k in keys):
            return
        engine.import_segment(key, tup)
        engine.store.lower.drain()
    raise RuntimeError("the fillers did not push the documents out of the pool")


def entry_keys(engine: LLMEngine, prompt) -> tuple[list[SegmentKey], int]:
    """The keys of a prompt's documents and the bytes of their entries."""
    jobs = [p.job for p in engine.pic.plan(prompt, "hypic", None)]
    return [job.key for job in jobs], sum(engine.store.layout.entry_bytes(j.interior[1] - j.interior[0]) for j in jobs)


def measure_tiers(engine: LLMEngine, shape: PromptShape, filler, rng: random.Random, repeats: int) -> dict:
    """Median TTFT (s) from the pool, from the host tier and by recompute (each after one unmeasured
    round: kernels compile for the shape), and the entries' bytes."""
    first = shape.prompt(shape.warm, rng)
    cold, _ = timed_request(engine, first, "hypic")
    say(f"{shape.name:>8} cold prompt (caches the documents): {cold:.1f} s")
    keys, entry_bytes = entry_keys(engine, first)
    timings = Timings()
    for round_ in range(repeats + 1):
        for tier in TIERS:
            if tier == "host":
                push_out(engine, keys, filler)
            measured = timed_request(engine, shape.prompt(shape.warm, rng), "none" if tier == "none" else "hypic")
            if round_:
                timings.add(tier, measured)
    return {**timings.medians(shape.name), "entry_bytes": entry_bytes}


def cache_disk_sets(engine: LLMEngine, shape: PromptShape, rng: random.Random) -> list[SegmentKey]:
    """Prefill every disk set once (cold); their documents' keys."""
    keys, start = [], time.perf_counter()
    for docs in shape.disk:
        prompt = shape.prompt(docs, rng)
        timed_request(engine, prompt, "hypic")
        keys += entry_keys(engine, prompt)[0]
    say(f"{shape.name:>8} {len(shape.disk)} disk sets prefilled cold in {time.perf_counter() - start:.1f} s")
    return keys


def first_engine(config: EngineConfig, shapes: list[PromptShape], rng: random.Random, parts: tuple[str, ...],
                 repeats: int) -> dict:
    """ttft's figures and the host tier's counters (when ttft runs); with disk among the parts, the
    disk sets cached on the way and written down to disk."""
    with started("first engine", config) as engine:
        filler = fillers(engine, max(len(shape.warm[0]) for shape in shapes), rng)
        figures, disk_keys = {}, []
        for shape in shapes:
            disk_keys += cache_disk_sets(engine, shape, rng) if "disk" in parts else []
            if "ttft" in parts:
                figures[shape.name] = measure_tiers(engine, shape, filler, rng, repeats)
        push_out(engine, disk_keys, filler)
        engine.store.lower.drain()
        return {"prompts": figures, "host_stats": dataclasses.asdict(engine.store.lower.stats())}


@contextlib.contextmanager
def started(name: str, config: EngineConfig) -> Iterator[LLMEngine]:
    """An engine, closed when the block ends (its pinned host memory goes back then)."""
    host_memory(f"before the {name} starts")
    with phase(f"{name} start"):
        engine = LLMEngine(config)
    try:
        yield engine
    finally:
        engine.close()


def measure_traced(engine: LLMEngine, shape: PromptShape, tier: str, sets: list[list[tuple[int, ...]]],
                   rng: random.Random) -> tuple[float, dict[str, int], list[dict]]:
    """(median TTFT (s), what served them, every request's trace) of one request per document set
    (the first unmeasured)."""
    timings, traces = Timings(), []
    for i, docs in enumerate(sets):
        seconds, kinds, trace = traced_request(engine, shape.prompt(docs, rng))
        say(f"{shape.name:>8} {tier:>4} request {i}: " + trace_line(trace))
        traces.append({"measured": bool(i), **trace})
        if i:
            timings.add(tier, (seconds, kinds))
    medians = timings.medians(shape.name)
    return medians[tier], medians["served_from"][tier], traces


def traced_request(engine: LLMEngine, prompt) -> tuple[float, dict[str, int], dict]:
    """`timed_request` (hypic mode), with where its time went: each step that ran a batch is
    charged to `compute_s` (the request runs alone: its cold segments' prefill, then its own), each
    that found nothing to run to what the request waited for as it began: a disk read of one of its
    segments (`read_s`), else its promotion copies landing (`copy_s`). Afterwards the disk writes
    its demotions caused and its late reads are let finish (so the next request runs alone) before
    its counts are taken: its segments read from disk (late ones included), recomputed as cheaper,
    late; and the pinned allocations made meanwhile."""
    sync()
    disk, allocations = engine.stats().segment_disk, pinned_allocations()
    start = last = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_mode="hypic")
    seq, spent, outputs = engine.requests[rid].completions[0].seq, dict.fromkeys(TRACED, 0.0), []
    while engine.has_work():
        waiting = waited_for(engine, seq)
        outputs += engine.step()
        if not engine.last_step_ran:
            time.sleep(IDLE_S)
        now, charged = time.perf_counter(), "compute_s" if engine.last_step_ran else waiting
        spent[charged], last = spent[charged] + now - last, now
    engine.store.lower.drain()
    engine.step()  # lands the reads that came late
    after = engine.stats().segment_disk
    counts = {"read": after.hits - disk.hits, "recomputed": after.recomputed - disk.recomputed,
              "late": after.late - disk.late, "pinned_allocations": pinned_allocations() - allocations}
    return last - start, outputs[-1].metrics.cached_tokens_by_kind, {"ttft_s": last - start, **spent, **counts}


def waited_for(engine: LLMEngine, seq: Sequence) -> str:
    """What a request waits for now (a `TRACED` key; `compute_s`: nothing)."""
    if seq.pic.awaiting & engine.pic.reads.keys():
        return "read_s"
    if seq.pic.attached and not seq.pic.awaiting and not all(p.entry.landed for p in seq.pic.cached):
        return "copy_s"
    return "compute_s"


def pinned_allocations() -> int:
    """torch's count of pinned host allocations so far (0 without CUDA)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return stats().get("num_host_alloc", 0) if stats is not None and torch.cuda.is_available() else 0


def trace_line(trace: dict) -> str:
    return (f"TTFT {trace['ttft_s'] * 1e3:.1f} ms = read {trace['read_s'] * 1e3:.1f} + copy "
            f"{trace['copy_s'] * 1e3:.1f} + compute {trace['compute_s'] * 1e3:.1f} ms; segments read "
            f"{trace['read']}, recomputed {trace['recomputed']}, late {trace['late']}; "
            f"{trace['pinned_allocations']} pinned allocations")


def start_rates(engine: LLMEngine) -> dict:
    """The rates a restarted engine decides reads by before its first request, and where the read rate came from."""
    disk, costs = engine.store.lower.disk, engine.pic.costs
    rates = {"read_bytes_per_s": disk.read_bytes_per_s, "read_rate": "probed" if disk.probed else "kept",
             "prefill_tokens_per_s": costs.tokens_per_s}
    say(f"restarted engine's rates: disk reads {rates['read_bytes_per_s'] / 1e9:.2f} GB/s ({rates['read_rate']}), "
        f"prefill {rates['prefill_tokens_per_s']:.0f} tokens/s")
    return rates


def restarted_engine(config: EngineConfig, shapes: list[PromptShape], rng: random.Random) -> dict:
    """Disk figures of an engine restarted on the first one's directory (its disk counters after
    them), then cold figures on it; the rates it started from."""
    with started("restarted engine", config) as engine:
        rates = start_rates(engine)
        pin_host_tier(engine)
        disk = {shape.name: measure_traced(engine, shape, "disk", shape.disk, rng) for shape in shapes}
        disk_stats = dataclasses.asdict(engine.stats().segment_disk)  # before the cold prompts write more
        figures = {}
        for shape in shapes:
            (seconds, served, traces), cold = disk[shape.name], measure_traced(
                engine, shape, "cold", [shape.fresh(rng) for _ in shape.disk], rng)
            figures[shape.name] = {"disk": seconds, "cold": cold[0], "served_from": served,
                                   "traces": {"disk": traces, "cold": cold[2]}}
        return {"rates_at_start": rates, "prompts": figures, "disk_stats_after_restart": disk_stats}


def drop_from_page_cache(directory: Path) -> None:
    """So that the restarted engine reads its segments from the disk, not from memory."""
    start = time.perf_counter()
    files = list(directory.rglob("*.seg"))
    for path in files:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    say(f"{len(files)} segment files synced and dropped from the page cache in {time.perf_counter() - start:.1f} s")


def host_target(name: str, figures: dict, host_to_device: float) -> dict:
    """The issue's target beside the host-tier figure: within the pool hit + the copy + 3 ms, and
    (at 4 x 4k) within 20 % of recompute."""
    budget = figures["pool"] + figures["entry_bytes"] / host_to_device + 3e-3
    within_budget, within_20pct = figures["host"] <= budget, figures["host"] <= 0.2 * figures["none"]
    target = {"host_budget": budget, "host_within_budget": within_budget,
              "host_over_none": figures["host"] / figures["none"], "host_within_20pct_of_none": within_20pct,
              "target_met": within_budget and (within_20pct or name != TWENTY_PERCENT_AT)}
    say(f"{name:>8} host target: budget {budget * 1e3:.1f} ms, host/none {target['host_over_none']:.1%}: "
        f"{'met' if target['target_met'] else 'MISSED'}")
    return target


def ttft_and_disk(record: ResultFile, config: EngineConfig, args: argparse.Namespace) -> None:
    """ttft on a first engine (with a disk tier only when the disk part follows: it writes the disk
    sets); disk on an engine restarted after it (after a writer engine of its own when ttft did not run)."""
    rng = random.Random(0)
    shapes = [PromptShape.random(n, length, args.repeats + 1, rng) for n, length in args.prompts]
    settings = {"pool_bytes": args.pool_bytes, "host_bytes": args.host_bytes, "repeats": args.repeats,
                "prompts": [f"{n}x{length}" for n, length in args.prompts]}
    if "ttft" in args.parts:
        ttft_part(record, config, args.parts, shapes, rng, settings)
    if "disk" in args.parts:
        disk_part(record, config, args, shapes, rng, settings)


def ttft_part(record: ResultFile, config: EngineConfig, parts: tuple[str, ...], shapes: list[PromptShape],
              rng: random.Random, settings: dict) -> None:
    first_config = config if "disk" in parts else dataclasses.replace(config, segment_disk_dir=None)
    rate = record.data["parts"]["copy"]["copy_bytes_per_s"]["host_to_device"]  # this run's: ttft brings copy
    with part(record, "ttft", {**settings, "disk_tier": "disk" in parts}) as saved:
        saved.update(first_engine(first_config, shapes, rng, parts, settings["repeats"]))
        saved["host_to_device_bytes_per_s"] = rate  # beside the targets it made (a copy-only run replaces copy's)
        for name, figures in saved["prompts"].items():
            figures.update(host_target(name, figures, rate))
    free_memory()


def disk_part(record: ResultFile, config: EngineConfig, args: argparse.Namespace, shapes: list[PromptShape],
              rng: random.Random, settings: dict) -> None:
    with part(record, "disk", {**settings, "disk_bytes": args.disk_bytes}) as saved:
        if "ttft" not in args.parts:  # ttft's engine wrote the disk sets when it ran
            first_engine(config, shapes, rng, args.parts, args.repeats)
            free_memory()
        drop_from_page_cache(Path(config.segment_disk_dir))
        saved.update(restarted_engine(config, shapes, rng))
    free_memory()


def free_memory() -> None:
    """Give the engine just closed's device memory back (its pinned host slabs stay cached by torch
    for the next engine)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- qps ------------------------------------------------------------------------------------------

def segment_layout(config: EngineConfig, model: Path) -> SegmentLayout:
    """The engines' segment layout, from the model's config alone (a meta-device model: no weights)."""
    with torch.device("meta"):
        cache = architecture(read_config_json(model)).model_cls(load_config(model)).cache_shape()
    dtype = resolve_dtype(config.dtype, torch.device(config.device))
    return SegmentLayout.from_cache_shape(cache, resolve_segment_state_dtype(config.segment_state_dtype, dtype), dtype)


def corpus_options(args: argparse.Namespace, model: Path, documents: int) -> list[str]:
    """`hypic bench serve` options of qps: the RAG workload over the whole corpus, preheated."""
    return ["--no-progress", "--no-plot", "--tokenizer", str(model), "--cache-modes", "hypic", "--preheat",
            "--documents", str(documents), "--doc-tokens", str(args.qps_doc_tokens), "--doc-tokens-range", "0",
            "--docs-per-request", str(args.qps_docs_per_request), "--max-tokens", "16",
            "--request-rate", args.qps_rates, "--num-requests", str(args.qps_requests)]


async def served_sweep(config: EngineConfig, options: list[str]) -> dict:
    """One rate sweep of `hypic bench serve` against an in-process server of `config`, and the
    server's /admin/cache afterwards."""
    host_memory("before the engine starts")
    client = InProcessEngineClient(config)
    await client.start()
    pin_host_tier(client.core)
    runner = runner_for(build_app(client, ServerSettings()), access_log=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        parser = argparse.ArgumentParser()
        add_bench_arguments(parser)
        bench = parser.parse_args(options)
        workload = build_workload(Tokenizer.from_dir(bench.tokenizer), bench)
        with StallWatch(client.core):
            swept = await run_sweeps(url, workload, bench, {})
        async with aiohttp.ClientSession() as session, session.get(url + "/admin/cache") as response:
            cache = await response.json()
    finally:
        await runner.cleanup()
        await client.shutdown(0.0)
    return {"workload": swept["workload"], "slo": swept["slo"], "series": swept["series"][0], "admin_cache": cache}


def pin_host_tier(engine: LLMEngine) -> None:
    """Every slab of the host tier, pinned before the sweep (the engine is idle): qps measures
    serving from the tier, not its pinning (a slab pinned beside the engine's steps holds the CUDA
    driver's lock for as long as it takes); the time it took, printed."""
    if engine.store.lower is None:
        return
    start, arena = time.perf_counter(), engine.store.lower.arena
    arena.fill()
    say(f"host tier: {arena.allocated_bytes / 2**30:.1f} GiB in {len(arena.slabs)} slabs pinned in "
        f"{time.perf_counter() - start:.1f} s")
    host_memory("with the host tier pinned")


def corpus_qps(config: EngineConfig, args: argparse.Namespace, model: Path, name: str) -> dict:
    """Sustainable QPS over a corpus `corpus_factor` GPU pools large, with the host tier (qps_host)
    or without it (qps_pool)."""
    entry_bytes = segment_layout(config, model).entry_bytes(args.qps_doc_tokens)
    documents = math.ceil(args.corpus_factor * args.pool_bytes / entry_bytes)
    say(f"{name}: corpus of {documents} documents ({documents * entry_bytes / 2**30:.1f} GiB of entries), "
        f"rates {args.qps_rates} req/s, {args.qps_requests} requests each")
    host_bytes = args.host_bytes if name == "qps_host" else 0
    tier_config = dataclasses.replace(config, segment_host_bytes=host_bytes, segment_disk_dir=None)
    with phase(name):
        figures = asyncio.run(served_sweep(tier_config, corpus_options(args, model, documents)))
    say(f"{name}: {sustainable_line(figures['series'])}")
    free_memory()
    return {"documents": documents, "entry_bytes": entry_bytes, "requests_per_rate": args.qps_requests, **figures}


def qps_settings(args: argparse.Namespace) -> dict:
    return {"pool_bytes": args.pool_bytes, "host_bytes": args.host_bytes, "corpus_factor": args.corpus_factor,
            "doc_tokens": args.qps_doc_tokens, "docs_per_request": args.qps_docs_per_request, "rates": args.qps_rates,
            "requests_per_rate": args.qps_requests}


def sustainable_line(series: dict) -> str:
    return (f"sustainable {series['sustainable']['rate']} req/s ({series['sustainable']['bound']}), "
            f"saturated {series['saturated_rps']:.1f} req/s")


# -- the run --------------------------------------------------------------------------------------

def engine_config(args: argparse.Namespace, disk_dir: str | None) -> tuple[EngineConfig, Path]:
    tiers = dict(segment_pool_bytes=args.pool_bytes, segment_host_bytes=args.host_bytes, max_num_seqs=32,
                 segment_disk_dir=disk_dir, segment_disk_bytes=args.disk_bytes)
    if args.device == "cpu":
        return EngineConfig(device="cpu", cpu_cache_bytes=args.pool_bytes + (64 << 20), max_model_len=4096,
                            max_num_batched_tokens=4096, **tiers), BUNDLED_MODEL
    shape = shape_config(args.shape, 32768)
    path = model_dir(shape)
    return EngineConfig(model=str(path), device="cuda", state_dict=random_weights(shape, 0), gpu_memory_utilization=0.9,
                        max_model_len=20480, max_num_batched_tokens=20480, **tiers), path


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    header = {"benchmark": "tiers", "device": device, "shape": args.shape if args.device == "cuda" else BUNDLED_MODEL.name}
    out = args.out or result_path("tiers", device_label(device), header["shape"])
    record = grouped_result(out, header, list(args.parts), finish=in_run_order)
    say(f"bench_tiers on {device}, {header['shape']}: parts {','.join(args.parts)}")
    with tempfile.TemporaryDirectory(prefix="hypic-tiers-", dir=args.disk_dir) as disk_dir:
        run_parts(record, args, disk_dir)
    report(record.data)
    return record.data


def run_parts(record: ResultFile, args: argparse.Namespace, disk_dir: str) -> None:
    if "copy" in args.parts:
        with part(record, "copy", {"bytes_per_copy": COPY_BYTES[args.device]}) as saved:
            saved["copy_bytes_per_s"] = copy_rates(torch.device(args.device), COPY_BYTES[args.device])
    if args.parts == ("copy",):
        return
    with phase("weights"):
        config, model = engine_config(args, disk_dir)
    if {"ttft", "disk"} & set(args.parts):
        ttft_and_disk(record, config, args)
    for name in QPS_PARTS:
        if name in args.parts:
            with part(record, name, qps_settings(args)) as saved:
                saved.update(corpus_qps(config, args, model, name))


def report(data: dict) -> None:
    """Every part the file holds (this run's and earlier runs'), in one table."""
    parts = data["parts"]
    runs = {name: measured_by(data, name) for name in parts}
    say(f"{data['device']}  {data['shape']}: " + ", ".join(f"{name} of {run['date'][:16]} ({run['commit'][:10]})"
                                                          for name, run in runs.items()))
    if "copy" in parts:
        rates = parts["copy"]["copy_bytes_per_s"]
        say(f"host->device {rates['host_to_device'] / 1e9:.1f} GB/s, device->host {rates['device_to_host'] / 1e9:.1f} "
            f"GB/s (pinned)")
    ttft, disk = parts.get("ttft", {}).get("prompts", {}), parts.get("disk", {}).get("prompts", {})
    if ttft or disk:
        say(f"{'prompt':>10} {'pool ms':>8} {'host ms':>8} {'budget ms':>10} {'disk ms':>8} {'cold ms':>8} "
            f"{'none ms':>8}  target")
    for name in dict.fromkeys([*ttft, *disk]):
        t = {**ttft.get(name, {}), **disk.get(name, {})}
        columns = " ".join(milliseconds(t.get(tier), width) for tier, width in
                           (("pool", 8), ("host", 8), ("host_budget", 10), ("disk", 8), ("cold", 8), ("none", 8)))
        target = "" if "target_met" not in t else "met" if t["target_met"] else "MISSED"
        say(f"{name:>10} {columns}  {target}")
    for name, label in QPS_PARTS.items():
        if name in parts:
            qps = parts[name]
            say(f"{label}, corpus of {qps['documents']} documents, {qps['requests_per_rate']} requests per rate: "
                f"{sustainable_line(qps['series'])}")


def milliseconds(seconds: float | None, width: int) -> str:
    return f"{'-':>{width}}" if seconds is None else f"{seconds * 1e3:{width}.1f}"


if __name__ == "__main__":
    main()
