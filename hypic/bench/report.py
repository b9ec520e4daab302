"""Benchmark results: the one way a result file is written and built across runs (`ResultFile`, with
the date, commit and command of each run: `run_record`), and bench serve's sweep results with their PNG
(TTFT and throughput against the offered rate, a line per series: a server or a cache mode; `hypic
bench plot` draws several result files together).

A result file can be built by several runs (a GPU lease too short for the whole benchmark): a run
merges what it measured into the file and keeps the rest, each part listed with the run that measured
it. bench serve --merge adds its series, or its rate points of a series, each point with its run
(`run`); a script's figure groups are listed under the run that measured them (`runs`). Runs merge
only when they measured the same settings (`differing`).
"""
from __future__ import annotations

import copy
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


def run_record(command: Sequence[str] | None = None) -> dict[str, str]:
    """Date, commit ("+dirty" when tracked files differ from it) and command line of this run (default:
    this Python process's, as `python script ...`)."""
    dirty = _git("status", "--porcelain", "--untracked-files=no") not in ("", "unknown")
    shown = _without_secrets(["python", *sys.argv] if command is None else command)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _git("rev-parse", "HEAD") + ("+dirty" if dirty else ""), "command": shlex.join(shown)}


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), *args], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


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
    """A run asked to merge into a result file of another benchmark, setup or layout (`differing`:
    each such field's value in the file and in this run)."""

    def __init__(self, path: Path, differing: dict[str, tuple[object, object]]) -> None:
        self.path, self.differing = path, differing
        fields = "; ".join(f"{name}: {theirs!r} in the file, {ours!r} now"
                           for name, (theirs, ours) in differing.items())
        super().__init__(f"{path} was measured with other settings, so this run cannot merge into it: {fields}. "
                         f"Give another --out, or move the file aside to start a new one")


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


def differing(previous: dict, settings: dict) -> dict[str, tuple[object, object]]:
    """The settings this run gives that the file does not share, as {name: (file's value, this run's)}:
    a dict-valued setting (a section) field by field ("section.field", the fields this run gives)."""
    found = {}
    for key, value in jsonable(settings).items():
        theirs = previous.get(key)
        if isinstance(value, dict):
            theirs = theirs if isinstance(theirs, dict) else {}
            found.update({f"{key}.{field}": (theirs.get(field), one) for field, one in value.items()
                          if theirs.get(field) != one})
        elif theirs != value:
            found[key] = (theirs, value)
    return found


Merge = Callable[[dict, Any], dict]


class ResultFile:
    """A benchmark's result file, built across runs (a GPU call too short for the whole benchmark):
    `part` is what this run measured so far, and each `write` replaces the file whole (atomically) by
    `merge(file, part)`, the file as it was when this run started ({} when there was none or
    `merging` is off). A file of other `settings` (see `differing`), or without the `needs` keys of
    its layout, is refused before anything is measured. `written(path, data)` runs after each write
    (a plot). How a part merges is the benchmark's: `merged_series` for bench serve's rate sweeps,
    `merged_groups` for figure groups."""

    def __init__(self, path: Path | None, settings: dict, merge: Merge, part: Any = None, *, merging: bool = True,
                 needs: Sequence[str] = (), written: Callable[[Path, dict], None] | None = None) -> None:
        """`path` None: the benchmark names it before the first write."""
        self.path, self.merge, self.part, self.written = path, merge, part, written
        self.previous = json.loads(path.read_text()) if merging and path is not None and path.exists() else {}
        missing = {key: (None, "present") for key in needs if self.previous and key not in self.previous}
        self._refuse(missing)
        self.check(settings)
        self.data = merge(self.previous, part) if part is not None else None  # the file's content

    def check(self, settings: dict) -> None:
        """Refuses a merge into a file of other settings (again when a setting becomes known)."""
        self._refuse(differing(self.previous, settings) if self.previous else {})

    def _refuse(self, found: dict[str, tuple[object, object]]) -> None:
        if found:
            raise MismatchedResults(self.path, found)

    def write(self, part: Any) -> dict:
        """The file merged with this run's part so far, written whole; returns the file's content."""
        self.part, self.data = part, self.merge(self.previous, part)
        write_json(self.path, self.data)
        if self.written is not None:
            self.written(self.path, self.data)
        return self.data


# -- figure groups: a script's figures saved group by group, each under the run that measured it -----

def group_part(header: dict, requested: Sequence[str]) -> dict:
    """A script run's part: its header (the benchmark and every setting whose figures must not be mixed),
    its run (date, commit, command, the groups asked for, the wall seconds of those measured) and its
    figures by JSON path."""
    return {"header": header, "run": {**run_record(), "requested": list(requested), "measured": {}}, "figures": {}}


def with_group(part: dict, name: str, figures: dict[tuple[str, ...], object], wall_s: float) -> dict:
    """The part with a measured group's figures (replacing any it measured before under that name)."""
    part["figures"].update(figures)
    part["run"]["measured"][name] = round(wall_s, 2)
    return part


def merged_groups(previous: dict, part: dict, finish: Callable[[dict], None] = lambda data: None) -> dict:
    """The file's figures with the part's put at their paths, each group listed under the last run that
    measured it (a run left with none is dropped), the file's date, commit and command this run's;
    `finish` then recomputes the derived figures (and key order) from the merged raw ones."""
    run, header = part["run"], part["header"]
    kept = copy.deepcopy({key: value for key, value in previous.items() if key not in header})
    data = {**header, **_record_of(run), "runs": [], **kept, **_record_of(run)}  # the file's key order
    for path, value in part["figures"].items():
        _put(data, path, value)
    earlier = [{**one, "measured": {name: s for name, s in one["measured"].items() if name not in run["measured"]}}
               for one in previous.get("runs", [])]
    data["runs"] = [one for one in earlier if one["measured"]] + [run]
    finish(data)
    return data


def _put(data: dict, path: tuple[str, ...], value: object) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def _record_of(run: dict) -> dict:
    return {key: run[key] for key in ("date", "commit", "command")}


def measured_by(data: dict, group: str) -> dict | None:
    """The run of a result file that measured `group` (None: no run did)."""
    return next((run for run in data["runs"] if group in run["measured"]), None)


# -- bench serve: series keyed by label, points keyed by rate ---------------------------------------

def sweep_settings(result: dict) -> dict:
    """What runs merged into one bench serve file must share."""
    return {"benchmark": result["benchmark"], **{section: result[section] for section in SETTINGS}}


def sweep_update(results: ResultFile, result: dict) -> None:
    """Writes bench serve's result so far once it has a point (checked again: the server has named its
    model by now), at default_out unless --out named the file."""
    results.check(sweep_settings(result))
    if any(one["points"] for one in result["series"]):
        results.path = results.path or default_out(result)
        results.write(result)


def plotted(path: Path, result: dict) -> None:
    """The PNG beside a bench serve file: every series it holds."""
    title = f"{result['server']['model']}: {result['workload']['kind']}"
    plot(path.with_suffix(".png"), result["series"], title, result["slo"]["ttft_s"])


def float_rates(result: dict) -> dict:
    """A bench serve result with its rates as floats (jsonable writes an infinite one as "inf")."""
    series = [{**one, "points": [{**point, **{key: float(point[key]) for key in RATES}} for point in one["points"]]}
              for one in result.get("series", [])]
    return {**result, "series": series}


def read_result(path: Path) -> dict:
    """A bench serve result file, its rates as floats."""
    return float_rates(json.loads(path.read_text()))


def read_series(paths: Sequence[Path]) -> list[dict]:
    """Every series of these result files, in order, each with its file's TTFT SLO (`slo_ttft_s`)."""
    series = []
    for path in paths:
        result = read_result(path)
        series += [{**one, "slo_ttft_s": result["slo"]["ttft_s"]} for one in result["series"]]
    return series


def merged_series(previous: dict, result: dict) -> dict:
    """`result` with the series of the file it did not measure: a point of the same series and rate is
    this run's, the others stay with their own runs; each series' SLO figures are computed again from
    its points. Series in the file's order, then this run's new ones."""
    slo = stats.Slo(**result["slo"])
    mine = {one["label"]: one for one in result["series"]}
    series = [_merged_series(one, mine.pop(one["label"], None), slo) for one in float_rates(previous)["series"]]
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
