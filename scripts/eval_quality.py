"""Quality of position-independent caching (paper Fig. 10, Fig. 13): accuracy and TTFT per cache mode.

For each setting — `none`, `prefix`, `naive`, and `hypic` at each seam width w — through the public
AsyncEngine API only:
- greedy exact-match accuracy per question kind (lookup, two_hop, linked, long) on held-out prompts
  that draw their notes from shared pools (hypic.data.eval_prompts), so notes recur across
  requests as in a real corpus; --concurrency requests in flight;
- TTFT on a separate sample run one request at a time (no queueing): cold = a fresh cache_salt, so
  nothing is cached; warm = the same notes again, now cached, in a new order (only the system
  prompt can come from the exact prefix cache);
- the fraction of prompt tokens, and of PIC interior tokens, served from cache.
Seam width is an engine setting: one engine per w; none, prefix and naive (no seam) share the
first. Each setting has its own cache_salt, so no mode reads another mode's cache.

Writes <out-prefix>.json, <out-prefix>.md and two PNG plots (scripts/plot_quality.py).
The drift of the running state (relative L2 and angle at the deepest linear layer) is measured by
scripts/bench_fidelity.py, not here.

    python scripts/eval_quality.py --device cuda          # the full run: 125 prompts per kind, 8 settings
    python scripts/eval_quality.py --device cpu --per-kind 4 --modes none,hypic --seam-widths 8
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from plot_quality import write_report
from results import device_label, result_path, run_record, variant
from tqdm import tqdm

from hypic import CACHE_MODES, AsyncEngine, EngineConfig, RequestMetrics, SamplingParams
from hypic.config import SEGMENT_STATE_DTYPES
from hypic.data import EVAL_SPEC, EVAL_SPEC_SINGLE_NAMES, KINDS, Prompt, eval_prompts, is_correct

ERRORS_KEPT = 2  # wrong replies kept per kind in the JSON, to see how a setting fails


@dataclass(frozen=True)
class Setting:
    mode: str
    seam_width: int | None  # None: the mode has no seam window

    @property
    def label(self) -> str:
        return self.mode if self.seam_width is None else f"{self.mode} w={self.seam_width}"


@dataclass(frozen=True)
class Reply:
    text: str
    metrics: RequestMetrics


def settings_of(modes: Sequence[str], widths: Sequence[int]) -> list[Setting]:
    return [Setting(mode, w) for mode in modes for w in (widths if mode == "hypic" else [None])]


def engine_groups(settings: list[Setting], widths: Sequence[int]) -> dict[int, list[Setting]]:
    """Settings by the seam width of the engine that runs them; seamless modes ride on the first."""
    groups: dict[int, list[Setting]] = {}
    for setting in settings:
        groups.setdefault(widths[0] if setting.seam_width is None else setting.seam_width, []).append(setting)
    return groups


def rotate_notes(prompt: Prompt) -> Prompt:
    """The same notes, the first moved last: every note is a cache hit, the token prefix is new."""
    notes = prompt.notes
    return dataclasses.replace(prompt, segments=(prompt.segments[0], *notes[1:], notes[0], prompt.segments[-1]))


# -- requests --------------------------------------------------------------------------------------

async def complete(engine: AsyncEngine, text: str, params: SamplingParams, setting: Setting, salt: str) -> Reply:
    pieces: list[str] = []
    async for out in engine.generate(text, params, cache_mode=setting.mode, cache_salt=salt,
                                     add_special_tokens=False):  # the text is a rendered chat template
        pieces += [delta.text for delta in out.deltas if delta.index == 0]
    return Reply("".join(pieces), out.metrics)


def interior_tokens(engine: AsyncEngine, text: str, setting: Setting, salt: str) -> int:
    """Tokens of the prompt's PIC interiors (0 in modes without PIC); call while the engine is idle."""
    jobs = engine.segment_jobs(text, cache_salt=salt, cache_mode=setting.mode)
    return sum(end - start for start, end in (job.interior for job in jobs))


async def accuracy_run(engine: AsyncEngine, prompts: list[Prompt], setting: Setting, args: argparse.Namespace,
                       bar: tqdm) -> dict:
    salt = f"eval:{setting.label}:{uuid.uuid4().hex}"
    interiors = [interior_tokens(engine, p.text(), setting, salt) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(prompt: Prompt) -> Reply:
        async with gate:
            reply = await complete(engine, prompt.text(), params, setting, salt)
        bar.update()
        return reply

    replies = await asyncio.gather(*(one(p) for p in prompts))
    await engine.flush_segments(salt)
    return {**exact_match(prompts, replies), **cache_use(replies, interiors, "")}


async def ttft_run(engine: AsyncEngine, prompts: list[Prompt], setting: Setting, bar: tqdm) -> dict:
    first_token = SamplingParams(temperature=0.0, max_tokens=1)
    cold, warm, interiors = [], [], []
    for prompt in prompts:
        salt = f"ttft:{setting.label}:{uuid.uuid4().hex}"  # nothing under this salt is cached yet
        cold.append(await complete(engine, prompt.text(), first_token, setting, salt))
        moved = rotate_notes(prompt).text()
        interiors.append(interior_tokens(engine, moved, setting, salt))
        warm.append(await complete(engine, moved, first_token, setting, salt))
        await engine.flush_segments(salt)
        bar.update(2)
    return {"ttft_ms": {"cold": ttft_summary(cold), "warm": ttft_summary(warm)},
            **cache_use(warm, interiors, "warm_")}


# -- measures --------------------------------------------------------------------------------------

def exact_match(prompts: list[Prompt], replies: list[Reply]) -> dict:
    """EM per kind and overall, counts, and a few wrong replies per kind."""
    right = {kind: [is_correct(r.text, p.answer) for p, r in zip(prompts, replies) if p.kind == kind]
             for kind in KINDS}
    every = [ok for oks in right.values() for ok in oks]
    errors = {kind: [{"answer": p.answer, "reply": r.text} for p, r in zip(prompts, replies)
                     if p.kind == kind and not is_correct(r.text, p.answer)][:ERRORS_KEPT] for kind in KINDS}
    em = {kind: _fraction(sum(oks), len(oks)) for kind, oks in right.items()}
    return {"em": {**em, "overall": _fraction(sum(every), len(every))},
            "count": {kind: len(oks) for kind, oks in right.items()}, "errors": errors}


def cache_use(replies: list[Reply], interiors: list[int], prefix: str) -> dict:
    """Prompt tokens served from any cache, and PIC interior tokens served from existing tuples."""
    cached = sum(r.metrics.cached_tokens for r in replies)
    prompt = sum(r.metrics.prompt_tokens for r in replies)
    hits = sum(r.metrics.cached_tokens_by_kind.get("pic", 0) for r in replies)
    return {f"{prefix}cached_fraction": _fraction(cached, prompt),
            f"{prefix}interior_hit_fraction": _fraction(hits, sum(interiors))}


def ttft_summary(replies: list[Reply]) -> dict[str, float]:
    times = [1e3 * r.metrics.ttft for r in replies if r.metrics.ttft is not None]
    return {"mean": statistics.fmean(times), "p50": statistics.median(times)} if times else {}


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None


# -- the run ---------------------------------------------------------------------------------------

def engine_config(args: argparse.Namespace, seam_width: int) -> EngineConfig:
    return EngineConfig(model=args.model, device=args.device, seam_width=seam_width,
                        max_num_seqs=args.concurrency, segment_state_dtype=args.segment_state_dtype)


async def run_engine(args: argparse.Namespace, width: int, group: list[Setting], prompts: list[Prompt],
                     bar: tqdm) -> tuple[dict, dict[Setting, dict]]:
    """One engine (seam width `width`): every setting of the group, accuracy run then TTFT sample."""
    results = {}
    async with AsyncEngine(engine_config(args, width)) as engine:
        for setting in group:
            bar.set_description(setting.label)
            start = time.perf_counter()
            accuracy = await accuracy_run(engine, prompts, setting, args, bar)
            timing = await ttft_run(engine, prompts[:args.ttft_samples], setting, bar)
            results[setting] = {**accuracy, **timing, "eval_s": time.perf_counter() - start}
        return run_header(engine), results


def run_header(engine: AsyncEngine) -> dict:
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    model_dir = engine.core.model_dir
    digest = xxhash.xxh64()
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return {"device": name, "model": engine.model_name, "model_dir": str(model_dir),
            "weights_xxh64": digest.hexdigest(), "dtype": str(engine.core.dtype).removeprefix("torch."),
            "segment_state_dtype": str(engine.core.store.layout.state_dtype).removeprefix("torch.")}


def release_device_memory() -> None:
    """The next engine plans its caches from free memory: hand the last one's back first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def evaluate(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """Every setting, engine by engine; `save` gets the result so far after each engine but the last
    (a run cut short by a time limit still leaves its finished settings)."""
    spec = EVAL_SPEC if args.names == "rich" else EVAL_SPEC_SINGLE_NAMES
    prompts = eval_prompts(args.per_kind, split=args.split, spec=spec)
    settings = settings_of(args.modes, args.seam_widths)
    samples = min(args.ttft_samples, len(prompts))
    results: dict[Setting, dict] = {}
    with tqdm(total=len(settings) * (len(prompts) + 2 * samples), unit="req",
              mininterval=1.0 if sys.stderr.isatty() else 30.0) as bar:
        for width, group in engine_groups(settings, args.seam_widths).items():
            header, found = await run_engine(args, width, group, prompts, bar)
            results.update(found)
            release_device_memory()
            result = assemble(args, header, len(prompts), samples, [(s, results[s]) for s in settings if s in results])
            if len(results) < len(settings):
                save({**result, "complete": False})
    return {**result, "complete": True}


def assemble(args: argparse.Namespace, header: dict, num_prompts: int, samples: int,
             done: list[tuple[Setting, dict]]) -> dict:
    run = {"split": args.split, "names": args.names, "restate": EVAL_SPEC.restate, "per_kind": args.per_kind,
           "num_prompts": num_prompts,
           "kinds": list(KINDS), "max_tokens": args.max_tokens, "concurrency": args.concurrency,
           "ttft_samples": samples, "state_drift": "scripts/bench_fidelity.py"}
    entries = [{"label": s.label, "mode": s.mode, "seam_width": s.seam_width, **found} for s, found in done]
    return {**run_record(), **header, **run, "settings": entries}


# -- command line ----------------------------------------------------------------------------------

def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in CACHE_MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes must be a comma list of {', '.join(CACHE_MODES)}; got {text!r}")
    return modes


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"seam widths must be integers: {error}") from error
    if not widths or min(widths) < 0:
        raise argparse.ArgumentTypeError(f"seam widths must be a comma list of integers >= 0; got {text!r}")
    return widths


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled model)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--per-kind", type=_positive, default=125, help="held-out prompts per question kind")
    parser.add_argument("--modes", type=_modes, default=list(CACHE_MODES), help="comma list of cache modes")
    parser.add_argument("--seam-widths", type=_widths, default=[0, 4, 8, 16, 32], help="hypic seam widths w")
    parser.add_argument("--split", default="test", choices=("validation", "test"))
    parser.add_argument("--names", default="rich", choices=("rich", "single"),
                        help="entity names of the held-out prompts: invented multi-token names (the benchmark), "
                             "or single-token common names (the same spec otherwise)")
    parser.add_argument("--max-tokens", type=_positive, default=48, help="tokens generated per answer")
    parser.add_argument("--concurrency", type=_positive, default=32, help="accuracy requests in flight")
    parser.add_argument("--segment-state-dtype", choices=SEGMENT_STATE_DTYPES,
                        help="storage of cached T and S0 (default: EngineConfig.segment_state_dtype's)")
    parser.add_argument("--ttft-samples", type=_positive, default=20,
                        help="prompts per setting timed one at a time, cold then warm")
    parser.add_argument("--out-prefix", type=Path, default=None,
                        help="writes PREFIX.json, PREFIX.md, PREFIX_ttft.png, PREFIX_seam.png "
                             "(default: bench/results/quality_<device>_<model>)")
    return parser.parse_args(argv)


def default_prefix(result: dict) -> Path:
    names = "single_names" if result["names"] == "single" else None
    return result_path("quality", device_label(result["device"]), variant(result["model"], names), suffix="")


def save_result(result: dict, out_prefix: Path | None) -> list[Path]:
    """PREFIX.json and the report beside it; returns the paths written."""
    prefix = out_prefix or default_prefix(result)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    json_path = prefix.parent / f"{prefix.name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    return [json_path, *write_report(result, prefix)]


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(evaluate(args, lambda partial: save_result(partial, args.out_prefix)))
    written = save_result(result, args.out_prefix)
    print(written[1].read_text())
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
