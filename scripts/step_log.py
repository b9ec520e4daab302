"""Where a server's steps went, from its debug step log (`--log-level debug`: one line a step, what it
held and each launched part's host/device ms): steps by what they launched, their times on the host
and the device, the longest ones, and a cold graph's device time by its chunk's tokens. `--from` /
`--to` pick a phase of a benchmark's log by the lines around it.

    python scripts/bench_starvation.py --server-command '... --log-level debug' > run.log 2>&1
    python scripts/step_log.py run.log --from 'wrote .*/idle.json' --to 'wrote .*/loaded.json' \
        --out bench/results/step_log_h200_qwen3_5_moe.json
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from hypic.bench.report import run_record, write_json

STEP = re.compile(r"step \d+: ([\d.]+) ms, (.*?); (.*?): (.*) ms, host/device$")
TOKENS = re.compile(r"(\d+) (decodes?|assembly|assemblies|prefills?|cold chunks?)(?: \((\d+) tokens\))?")
COLD_BINS = (128, 256, 384, 512, 1024, 16384)  # a cold graph's tokens, binned by their upper bound


@dataclass(frozen=True)
class Step:
    ms: float
    held: str  # "4 decodes, 1 cold chunk (511 tokens)"
    launched: str  # "decode graph + 1 cold graph"
    device_ms: tuple[float, ...]  # each part's the step waited for, in launch order

    @property
    def kind(self) -> str:
        """What it launched, counts left out: "decode graph + n cold graph"."""
        return re.sub(r"\d+", "n", self.launched)

    def tokens(self, kind: str) -> int | None:
        """The tokens of the step's `kind` of work ("cold chunk"), None if it holds none."""
        for m in TOKENS.finditer(self.held):
            if m.group(2).startswith(kind.split()[0]) and m.group(3):
                return int(m.group(3))
        return None


def parse(lines: list[str]) -> list[Step]:
    steps = []
    for line in lines:
        if m := STEP.search(line):
            # a part on the cold lane has its host time alone: the step never waited for it
            device = tuple(float(part.split("/")[1]) for part in m.group(4).split(", ") if "/" in part)
            steps.append(Step(float(m.group(1)), m.group(2), m.group(3), device))
    return steps


def phase(lines: list[str], start: str | None, end: str | None) -> list[str]:
    """The lines after the first matching `start` and before the first matching `end` after it."""
    first = next((i + 1 for i, line in enumerate(lines) if re.search(start, line)), None) if start else 0
    if first is None:
        sys.exit(f"no line matches --from {start!r}")
    last = next((i for i in range(first, len(lines)) if re.search(end, lines[i])), len(lines)) if end else len(lines)
    return lines[first:last]


def summary(steps: list[Step]) -> dict:
    """By kind: the steps' ms (the engine's, until it read its tokens: a step that samples nothing, cold
    chunks alone, returns before its graph ends and the next one waits for it) and their parts' device ms."""
    by_kind: dict[str, list[Step]] = {}
    for step in steps:
        by_kind.setdefault(step.kind, []).append(step)
    kinds = {kind: {"steps": len(group), "ms_p50": statistics.median(s.ms for s in group),
                    "ms_max": max(s.ms for s in group), "ms_total": sum(s.ms for s in group),
                    "device_ms_p50": statistics.median(sum(s.device_ms) for s in group)}
             for kind, group in sorted(by_kind.items(), key=lambda item: -len(item[1]))}
    longest = sorted(steps, key=lambda s: -s.ms)[:10]
    return {"steps": len(steps), "ms_total": sum(s.ms for s in steps), "by_kind": kinds,
            "longest": [{"ms": s.ms, "held": s.held, "launched": s.launched, "device_ms": s.device_ms}
                        for s in longest],
            "cold_graph_device_ms": cold_graphs(steps)}


def cold_graphs(steps: list[Step]) -> dict[str, dict]:
    """A lone cold graph's device time (its step's last part) by its chunk's tokens, binned."""
    bins: dict[int, list[float]] = {}
    for step in steps:
        tokens = step.tokens("cold chunk")
        if tokens is not None and step.launched.endswith("1 cold graph"):
            bins.setdefault(next(b for b in COLD_BINS if tokens <= b), []).append(step.device_ms[-1])
    edges = dict(zip(COLD_BINS, (0, *COLD_BINS)))
    return {f"{edges[b] + 1}-{b}": {"graphs": len(ms), "ms_p50": statistics.median(ms)}
            for b, ms in sorted(bins.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path)
    parser.add_argument("--from", dest="start", help="a regex: the phase starts after its first match")
    parser.add_argument("--to", dest="end", help="a regex: the phase ends before its first match after --from")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = args.log.read_text().splitlines()
    result = {"benchmark": "step_log", **run_record(), "log": args.log.name, "from": args.start, "to": args.end,
              "log_first_line": lines[0][:23] if lines else None, **summary(parse(phase(lines, args.start, args.end)))}
    if args.out:
        write_json(args.out, result)
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
