"""Results of a sweep: the JSON file and its PNG (TTFT and throughput against the offered rate, a
line per series: a server or a cache mode)."""
from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hypic.errors import HypicError


class MissingBenchDependency(HypicError):
    """A package of the `bench` extra is not installed."""

    def __init__(self, package: str, needed_for: str, flag: str) -> None:
        super().__init__(f"{needed_for} needs {package}, which is not installed: pip install 'hypic[bench]' "
                         f"(or pip install {package}), or pass {flag}")


def require(package: str, needed_for: str, flag: str) -> None:
    """Fail before any request goes out when a bench-extra package is missing."""
    try:
        __import__(package)
    except ImportError:
        raise MissingBenchDependency(package, needed_for, flag) from None


def provenance() -> dict:
    """Date, commit and command line of this run."""
    root = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "command": " ".join(["hypic", *sys.argv[1:]])}


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result), indent=2, allow_nan=False) + "\n")


def jsonable(value: object) -> object:
    """Strict JSON: an infinite rate (everything at once) is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


def plot(path: Path, series: Sequence[dict], title: str) -> None:
    """Two panels: p50 / p99 TTFT against the offered rate, and achieved throughput against it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for one in series:
        points = [p for p in one["points"] if math.isfinite(p["request_rate"])]
        rates = [p["request_rate"] for p in points]
        line, = latency.plot(rates, [p["ttft_p50_s"] for p in points], marker="o", label=f"{one['label']} p50")
        latency.plot(rates, [p["ttft_p99_s"] for p in points], marker="x", ls="--", color=line.get_color(),
                     label=f"{one['label']} p99")
        throughput.plot(rates, [p["achieved_rps"] for p in points], marker="o", label=one["label"])
    latency.set(xlabel="offered rate (req/s)", ylabel="TTFT (s)", yscale="log", title="time to first token")
    throughput.set(xlabel="offered rate (req/s)", ylabel="achieved (req/s)", title="throughput")
    for axes in (latency, throughput):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
