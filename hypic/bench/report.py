"""Results of a sweep: the JSON file and its PNG (TTFT and throughput against the offered rate, a
line per series: a server or a cache mode). `hypic bench plot` draws several result files together."""
from __future__ import annotations

import datetime
import json
import math
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from hypic.errors import HypicError


class MissingBenchDependency(HypicError):
    """A package of the `bench` extra is not installed."""

    def __init__(self, package: str, needed_for: str, flag: str | None) -> None:
        super().__init__(f"{needed_for} needs {package}, which is not installed: pip install 'hypic[bench]' "
                         f"(or pip install {package})" + (f", or pass {flag}" if flag else ""))


def require(package: str, needed_for: str, flag: str | None = None) -> None:
    """Fail before any request goes out when a bench-extra package is missing."""
    try:
        __import__(package)
    except ImportError:
        raise MissingBenchDependency(package, needed_for, flag) from None


def provenance(command: Sequence[str]) -> dict:
    """Date, commit and command line of this run."""
    root = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "command": shlex.join(_without_secrets(command))}


def _without_secrets(argv: Sequence[str]) -> list[str]:
    """The command line with an --api-key value masked: result files get shared."""
    shown = list(argv)
    for i, item in enumerate(shown):
        if item == "--api-key" and i + 1 < len(shown):
            shown[i + 1] = "***"
        elif item.startswith("--api-key="):
            shown[i] = "--api-key=***"
    return shown


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


def read_series(paths: Sequence[Path]) -> list[dict]:
    """Every series of these result files, in order, rates back as floats ("inf" included), each
    with its file's TTFT SLO (`slo_ttft_s`)."""
    series = []
    for path in paths:
        result = json.loads(path.read_text())
        for one in result["series"]:
            points = [{**point, "request_rate": float(point["request_rate"])} for point in one["points"]]
            series.append({**one, "points": points, "slo_ttft_s": result["slo"]["ttft_s"]})
    return series


def summary_line(series: dict, slo_ttft: float) -> str:
    rate = series["sustainable"]
    return (f"{series['label']}: sustainable {rate['rate']:.3g} req/s ({rate['bound']}) at p50 TTFT <= {slo_ttft:g} s; "
            f"saturated {series['saturated_rps']:.2f} req/s, {series['saturated_output_tokens_per_s']:.0f} output tok/s")


def plot(path: Path, series: Sequence[dict], title: str, slo_ttft: float | None) -> None:
    """Two panels: p50 / p99 TTFT against the offered rate (and the SLO), and achieved throughput."""
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
    if slo_ttft is not None:
        latency.axhline(slo_ttft, color="grey", ls=":", label=f"SLO {slo_ttft:g} s")
    latency.set(xlabel="request rate (req/s)", ylabel="TTFT (s)", yscale="log", title="time to first token")
    throughput.set(xlabel="request rate (req/s)", ylabel="achieved (req/s)", title="throughput")
    for axes in (latency, throughput):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
