"""Where a benchmark writes its result, and what every result records about the run that made it.

A result is bench/results/<benchmark>_<device>_<shape>.json (e.g. pic_h200_qwen3_5_moe.json): one per
benchmark, device and shape, so a new run replaces the figure it supersedes (git keeps the old one).
Each holds the date, the commit and the command of its run; bench/RESULTS.md indexes them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"


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


def run_record() -> dict[str, str]:
    """Date, commit ("+dirty" when tracked files differ from it) and command line of this run."""
    dirty = _git("status", "--porcelain", "--untracked-files=no") not in ("", "unknown")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": _git("rev-parse", "HEAD") + ("+dirty" if dirty else ""),
            "command": shlex.join(["python", *sys.argv])}


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except OSError:  # no git on this machine
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


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
    record["runs"][args.label] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": tree_commit(args.tree), "command": shlex.join(["python", *sys.argv]),
        "server_options": server_options, "results": results,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


def tree_commit(tree: Path) -> str:
    """The commit of a hypic source tree (a git checkout, or an exported tree with a COMMIT file)."""
    stamp = tree / "COMMIT"  # an exported tree (git archive) has no .git: its commit is written beside it
    if stamp.is_file():
        return stamp.read_text().strip()
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"
