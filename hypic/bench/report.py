"""Results of a sweep: the JSON file and its PNG (TTFT and throughput against the offered rate, a
line per series: a server or a cache mode). `hypic bench plot` draws several result files together.

A result file can be built by several runs (a GPU lease too short for the whole sweep): a run with
--merge adds its series, or its rate points of a series, to the file and keeps the rest, each point
with the date, commit and command of the run that measured it (`run`). Runs merge only when they
measured the same workload, SLO and server (`SETTINGS`)."""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from hypic.bench import stats
from hypic.errors import HypicError

SETTINGS = ("server", "workload", "slo")  # what runs merged into one file must share
RATES = ("request_rate", "offered_rps")  # a point's fields that may be infinite


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


class MismatchedResults(HypicError):
    """A run asked to merge into a result file measured with other settings."""

    def __init__(self, path: Path, fields: Sequence[str]) -> None:
        super().__init__(f"{path} was measured with other settings, so this run cannot merge into it: "
                         f"{'; '.join(fields)}. Give another --out, or run without --merge to replace it")


def write_json(path: Path, result: dict) -> None:
    """Written whole or not at all (a run killed while writing leaves the previous file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(jsonable(result), indent=2, allow_nan=False) + "\n")
    os.replace(partial, path)


def jsonable(value: object) -> object:
    """Strict JSON: an infinite rate (everything at once) is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


def read_result(path: Path) -> dict:
    """A result file with its rates back as floats (jsonable wrote an infinite one as "inf")."""
    result = json.loads(path.read_text())
    for one in result["series"]:
        one["points"] = [{**point, **{key: float(point[key]) for key in RATES}} for point in one["points"]]
    return result


def read_series(paths: Sequence[Path]) -> list[dict]:
    """Every series of these result files, in order, each with its file's TTFT SLO (`slo_ttft_s`)."""
    series = []
    for path in paths:
        result = read_result(path)
        series += [{**one, "slo_ttft_s": result["slo"]["ttft_s"]} for one in result["series"]]
    return series


def differing(previous: dict, current: dict) -> list[str]:
    """The settings `current` gives that `previous` does not share, as "section.field: file's value,
    this run's value" (sections of SETTINGS that `current` has; fields that it has)."""
    found = []
    for section in (name for name in SETTINGS if name in current):
        theirs = previous.get(section) or {}
        found += [f"{section}.{field}: {theirs.get(field)!r} in the file, {value!r} now"
                  for field, value in jsonable(current[section]).items() if theirs.get(field) != value]
    return found


def merged(previous: dict, result: dict) -> dict:
    """`result` with the series of `previous` it did not measure: a point of the same series and
    rate is this run's, the others stay with their own runs; each series' SLO figures are computed
    again from its points. Series in the file's order, then this run's new ones."""
    slo = stats.Slo(**result["slo"])
    mine = {one["label"]: one for one in result["series"]}
    series = [_merged_series(one, mine.pop(one["label"], None), slo) for one in previous["series"]]
    return {**result, "series": series + list(mine.values())}


def _merged_series(kept: dict, new: dict | None, slo: stats.Slo) -> dict:
    if new is None:
        return kept
    rates = {point["request_rate"] for point in new["points"]}
    points = sorted([p for p in kept["points"] if p["request_rate"] not in rates] + new["points"],
                    key=lambda point: point["request_rate"])
    return {**new, "points": points, **series_figures(points, slo)}


def series_figures(points: Sequence[dict], slo: stats.Slo) -> dict:
    """A series' sustainable rate and saturated throughput."""
    return {"sustainable": stats.sustainable_rate(points, slo), **stats.saturation(points)}


class ResultFile:
    """Where a run's result goes: written whole after every point (a killed run keeps what it
    measured), merged into the file there when `merge` (after a check of the settings), and drawn
    (`plot`: every series of the file)."""

    def __init__(self, path: Path | None, merge: bool, plot: bool) -> None:
        """`path` None: default_out of the first result written."""
        self.path, self.plot = path, plot
        self.previous = read_result(path) if merge and path is not None and path.exists() else None
        self.written: dict | None = None  # the file's content

    def check(self, settings: dict) -> None:
        """Refuses, before anything is measured, a merge into a file of other settings."""
        if self.previous is None:
            return
        problems = differing(self.previous, settings)
        if self.previous.get("benchmark") != "bench_serve":
            problems.insert(0, f"benchmark: {self.previous.get('benchmark')!r} in the file, 'bench_serve' now")
        if problems:
            raise MismatchedResults(self.path, problems)

    def update(self, result: dict) -> dict:
        """Writes this run's result so far (merged) once it has a point; returns the file's content."""
        self.check(result)
        if not any(one["points"] for one in result["series"]):
            return self.previous or result
        whole = result if self.previous is None else merged(self.previous, result)
        self.path = self.path or default_out(whole)
        write_json(self.path, whole)
        if self.plot:
            title = f"{whole['server']['model']}: {whole['workload']['kind']}"
            plot(self.path.with_suffix(".png"), whole["series"], title, whole["slo"]["ttft_s"])
        self.written = whole
        return whole


def default_out(result: dict) -> Path:
    """bench/results/bench_serve_<device>_<model>.json, the device from the server's start-up line."""
    device = re.search(r" on (\S+):", result.get("startup_line") or "")
    label = device.group(1).replace(":", "") if device else "remote"
    return Path("bench") / "results" / f"bench_serve_{label}_{result['server']['model']}.json"


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
