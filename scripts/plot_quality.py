"""The report of scripts/eval_quality.py, from its JSON: a markdown table and two PNG plots
(exact match vs TTFT per setting; exact match vs seam width w).

    python scripts/plot_quality.py bench/results/quality_h200_default_model.json   # rewrites the .md and .png beside it
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

MODE_COLORS = {"none": "tab:gray", "prefix": "tab:blue", "naive": "tab:red", "hypic": "tab:green"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # one per setting: equal points stay apart in the legend


def write_report(result: dict, prefix: Path) -> list[Path]:
    """Writes PREFIX.md, PREFIX_ttft.png and PREFIX_seam.png; returns their paths."""
    paths = [prefix.parent / f"{prefix.name}{suffix}" for suffix in (".md", "_ttft.png", "_seam.png")]
    paths[0].write_text(markdown(result))
    plot_accuracy_vs_ttft(result, paths[1])
    plot_accuracy_vs_width(result, paths[2])
    return paths


# -- markdown --------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    kinds = result["kinds"]
    head = ["setting", *kinds, "overall", "TTFT cold mean / p50 (ms)", "TTFT warm mean / p50 (ms)",
            "cached (accuracy run)", "interiors from cache (accuracy run / warm)"]
    rows = [_row(entry, kinds) for entry in result["settings"]]
    table = [_line(head), _line(["---"] * len(head)), *map(_line, rows)]
    return "\n".join([f"# Quality of PIC per cache mode ({result['model']}, {result['device']})", "",
                      _summary(result), "", "Exact match (%) per question kind:", "", *table, "", _legend(result), ""])


NAMES = {"rich": "invented multi-token names", "single": "single-token names"}


def _summary(result: dict) -> str:
    partial = "" if result.get("complete", True) else " **Partial: the run stopped before its last settings.**"
    return (f"{result['date']} · {result['device']} · model `{result['model']}` ({result['dtype']}, weights "
            f"xxh64 {result['weights_xxh64']}) · {result['num_prompts']} held-out prompts ({result['per_kind']} "
            f"per kind, split {result['split']}, {NAMES[result.get('names', 'rich')]}) · greedy, at most "
            f"{result['max_tokens']} tokens, {result['concurrency']} in flight · cached T and S0 in "
            f"{result.get('segment_state_dtype', 'float32')} · TTFT over {result['ttft_samples']} prompts per "
            f"setting, one at a time.{partial}")


def _legend(result: dict) -> str:
    return ("Cold: a fresh cache salt, nothing cached. Warm: the same notes, already cached, in a new order "
            "(only the system prompt can come from the exact prefix cache). Cached: prompt tokens served from "
            "any cache. Interiors from cache: PIC interior tokens whose tuple existed at admission. "
            f"State drift (relative L2, angle): `{result['state_drift']}`.")


def _row(entry: dict, kinds: list[str]) -> list[str]:
    ttft = entry["ttft_ms"]
    interiors = f"{_pct(entry['interior_hit_fraction'])} / {_pct(entry['warm_interior_hit_fraction'])}"
    return [entry["label"], *(_pct(entry["em"][k]) for k in [*kinds, "overall"]), _ms(ttft["cold"]),
            _ms(ttft["warm"]), _pct(entry["cached_fraction"]), interiors]


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _ms(summary: dict[str, float]) -> str:
    return f"{summary['mean']:.1f} / {summary['p50']:.1f}" if summary else "–"


# -- plots (matplotlib only here, imported when a plot is drawn) -----------------------------------

def plot_accuracy_vs_ttft(result: dict, path: Path) -> None:
    """One point per setting: filled at the warm mean TTFT, hollow at the cold one; hypic's w by marker."""
    fig, ax = _axes()
    for index, entry in enumerate(result["settings"]):
        warm, cold = entry["ttft_ms"]["warm"], entry["ttft_ms"]["cold"]
        if not warm:
            continue
        color, em, marker = MODE_COLORS[entry["mode"]], _em_pct(entry), MARKERS[index % len(MARKERS)]
        ax.plot([cold["mean"], warm["mean"]], [em, em], color=color, linewidth=0.8, alpha=0.5)
        ax.scatter([cold["mean"]], [em], marker=marker, facecolors="none", edgecolors=color)
        ax.scatter([warm["mean"]], [em], marker=marker, color=color, label=entry["label"])
    ax.set_xlabel("TTFT, mean (ms): filled warm, hollow cold")
    ax.set_title(f"Exact match vs TTFT ({result['device']})")
    _save(fig, ax, path)


def plot_accuracy_vs_width(result: dict, path: Path) -> None:
    """hypic's exact match over w (overall bold, per kind thin) against the seamless modes' levels."""
    fig, ax = _axes()
    hypic = sorted((e for e in result["settings"] if e["mode"] == "hypic"), key=lambda e: e["seam_width"])
    widths = [e["seam_width"] for e in hypic]
    for kind in result["kinds"]:
        ax.plot(widths, [_em_pct(e, kind) for e in hypic], marker=".", linewidth=0.8, alpha=0.7, label=f"hypic {kind}")
    ax.plot(widths, [_em_pct(e) for e in hypic], marker="o", linewidth=2.2, color=MODE_COLORS["hypic"],
            label="hypic overall")
    for entry in (e for e in result["settings"] if e["mode"] != "hypic"):
        ax.axhline(_em_pct(entry), color=MODE_COLORS[entry["mode"]], linestyle="--", label=f"{entry['label']} overall")
    ax.set_xticks(widths)
    ax.set_xlabel("seam width w (tokens recomputed on each side of a boundary)")
    ax.set_title(f"Exact match vs seam width ({result['device']})")
    _save(fig, ax, path)


def _em_pct(entry: dict, kind: str = "overall") -> float:
    value = entry["em"][kind]
    return float("nan") if value is None else 100 * value


def _axes():
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.subplots()
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=150, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a JSON written by scripts/eval_quality.py")
    args = parser.parse_args()
    prefix = args.result.parent / args.result.stem
    for path in write_report(json.loads(args.result.read_text()), prefix):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
