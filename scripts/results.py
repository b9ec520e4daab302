"""Where a benchmark writes its result, and what every result records about the run that made it.

A result is bench/results/<benchmark>_<device>_<shape>.json (e.g. pic_h200_qwen3_5_moe.json): one per
benchmark, device and shape, so a new run replaces the figure it supersedes (git keeps the old one).
Each holds the date, the commit and the command of its run; bench/RESULTS.md indexes them.

A benchmark too long for one GPU call builds its file across runs (hypic.bench.report's ResultFile,
made here by grouped_result): each figure group is written as soon as it is measured, and a run of
some groups replaces those in the file and keeps the others, each listed under the run that measured it.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hypic.bench.report import ResultFile, group_part, merged_groups, run_record, with_group, write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
_START = time.perf_counter()  # "since start" in progress lines: a call's time limit counts from about here


def device_label(device_name: str, count: int = 1) -> str:
    """The device part of a result's name: "cpu", or the GPU's model in lower case ("NVIDIA H200" -> "h200",
    "h200x2" for two of them)."""
    label = "cpu" if device_name.lower().startswith("cpu") else device_name.split()[-1].lower()
    return label if count == 1 else f"{label}x{count}"


def result_path(benchmark: str, device: str, shape: str, suffix: str = ".json") -> Path:
    """`device` is a label from device_label; `shape` names the model shape and any variant measured."""
    return RESULTS_DIR / f"{benchmark}_{device}_{shape}{suffix}"


def variant(shape: str, *parts: str | None) -> str:
    """A shape with the settings that set a run apart ("qwen3_5_moe", "float32" -> "qwen3_5_moe_float32")."""
    return "_".join([shape, *(part for part in parts if part)])


def before_after_arguments(description: str, out: Path | None,
                           options: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The command line of a benchmark that measures one tree under a label ("before" a fix on an
    exported tree, "after" on this one) and keeps every label's run in one file; `options` adds the
    benchmark's own (an `out` of None is the benchmark's to fill in from them)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="before | after")
    parser.add_argument("--tree", type=Path, default=Path("."), help="the hypic source tree the server runs from")
    parser.add_argument("--out", type=Path, default=out)
    if options is not None:
        options(parser)
    return parser.parse_args()


def write_labelled_run(args: argparse.Namespace, benchmark: str, server_options: list[str], results: dict) -> None:
    """Merges this run's figures under its label into args.out, with the date, commit and command."""
    record = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": benchmark, "runs": {}}
    record["runs"][args.label] = {**run_record(), "commit": tree_commit(args.tree), "server_options": server_options,
                                  "results": results}
    write_json(args.out, record)
    print(f"wrote {args.out}")


def tree_commit(tree: Path) -> str:
    """The commit of a hypic source tree (a git checkout, or an exported tree with a COMMIT file)."""
    stamp = tree / "COMMIT"  # an exported tree (git archive) has no .git: its commit is written beside it
    if stamp.is_file():
        return stamp.read_text().strip()
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


# -- results built across runs ---------------------------------------------------------------------

def grouped_result(path: Path, header: dict, requested: list[str],
                   finish: Callable[[dict], None] | None = None) -> ResultFile:
    """The result file of a benchmark saved group by group (`header`: the benchmark's name and every
    field whose figures must not be mixed; `requested`: this run's groups; `finish` recomputes derived
    figures from the merged raw ones before each write). Refuses, before anything is measured, a file
    of another header or one written whole before results could merge (no `runs`)."""
    merge = merged_groups if finish is None else functools.partial(merged_groups, finish=finish)
    return ResultFile(path, header, merge, group_part(header, requested), needs=("runs",))


@contextlib.contextmanager
def group(record: ResultFile, name: str) -> Iterator[dict[tuple[str, ...], object]]:
    """A figure group: fill the dict yielded ({JSON path: value}); written with its wall seconds when the
    block ends (not when it raises)."""
    figures: dict[tuple[str, ...], object] = {}
    with phase(name) as clock:
        yield figures
        record.write(with_group(record.part, name, figures, clock()))
        run = record.part["run"]
        say(f"wrote {record.path} ({len(run['measured'])} of {len(run['requested'])} groups of this run)")


def by_number(figures: dict) -> dict:
    """Figures keyed "4096", "4x1024", ... in the order of the numbers in their keys (runs merge in any order)."""
    return dict(sorted(figures.items(), key=lambda item: [int(n) for n in re.findall(r"\d+", item[0])]))


def graph_ms(call: Callable[[], object], calls_per_graph: int = 20, replays: int = 10) -> float:
    """Milliseconds a call of a CUDA kernel launcher, from replays of a graph of `calls_per_graph` calls
    (the GPU's time, not the host's launch cost); the call runs once first (compiles, autotunes)."""
    import torch

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            call()
    graph.replay()  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * calls_per_graph)


def int_list(text: str) -> list[int]:
    """A comma list of integers; "" is none (a run that measures none of that kind)."""
    return [int(x) for x in text.split(",") if x]


def segment_state_dtype_name(requested: str | None, device_type: str) -> str:
    """The storage dtype of cached T and S0 an engine on `device_type` will use (EngineConfig's rule)."""
    import torch

    from hypic.engine.setup import resolve_dtype, resolve_segment_state_dtype
    dtype = resolve_segment_state_dtype(requested, resolve_dtype(None, torch.device(device_type)))
    return str(dtype).removeprefix("torch.")


def started_engine(engine_config: Callable[[], object]):
    """The LLMEngine of engine_config() (which makes any random weights), the wall seconds of the weights
    and of the engine start printed."""
    from hypic.engine.llm_engine import LLMEngine
    with phase("weights"):
        config = engine_config()
    with phase("engine start"):
        return LLMEngine(config)


# -- progress ---------------------------------------------------------------------------------------

def say(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def phase(name: str) -> Iterator[Callable[[], float]]:
    """Prints the start and (when it succeeds) the end of a phase with its wall seconds, and the seconds
    since this module was imported (about when the script started); yields the phase's clock."""
    start = time.perf_counter()
    say(f"== {name}: start")
    yield lambda: time.perf_counter() - start
    say(f"== {name}: done in {time.perf_counter() - start:.1f} s ({time.perf_counter() - _START:.0f} s since start)")
