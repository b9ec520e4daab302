"""scripts/step_log.py against a hand-written debug log in the engine's own step-line format."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import step_log  # noqa: E402
from hypic.engine.llm_engine import _step_line  # noqa: E402
from hypic.engine.runner import ModelRunner  # noqa: E402

LOG = """\
2026-12-04 02:41:02,094 INFO hypic: ready
x wrote /tmp/a/idle.json
2026-12-04 02:41:44,595 DEBUG hypic: step 10: 8.8 ms, 3 decodes; decode graph: 0.4/5.3 ms, host/device
2026-12-04 02:41:44,600 DEBUG hypic: step 11: 43.6 ms, 6 decodes, 1 cold chunk (511 tokens); decode graph + 1 cold graph: 0.4/7.8, 3.2/32.6 ms, host/device
2026-12-04 02:41:44,650 DEBUG hypic: step 12: 24.1 ms, 1 cold chunk (100 tokens); 1 cold graph: 1.1/22.0 ms, host/device
2026-12-04 02:41:44,700 DEBUG hypic: step 13: 64.1 ms, 7 decodes, 1 assembly (70 tokens), 1 cold chunk (508 tokens); decode graph + 1 assembly graph + 1 cold graph: 0.3/8.0, 1.7/20.8, 1.3/32.2 ms, host/device
2026-12-04 02:41:44,800 DEBUG hypic: step 14: 5.0 ms, 2 decodes; decode graph: 0.3/4.0 ms, host/device
x wrote /tmp/a/loaded.json
2026-12-04 02:41:45,000 DEBUG hypic: step 15: 169.2 ms, 7 cold chunks (3711 tokens); eager: 163.4/163.4 ms, host/device
"""


def test_a_phase_sums_steps_by_kind_and_bins_lone_cold_graphs() -> None:
    lines = step_log.phase(LOG.splitlines(), r"wrote .*/idle\.json", r"wrote .*/loaded\.json")
    result = step_log.summary(step_log.parse(lines))
    assert result["steps"] == 5 and result["ms_total"] == pytest.approx(8.8 + 43.6 + 24.1 + 64.1 + 5.0)
    assert result["by_kind"]["decode graph"] == {"steps": 2, "ms_p50": pytest.approx(6.9), "ms_max": 8.8,
                                                 "ms_total": pytest.approx(13.8), "device_ms_p50": pytest.approx(4.65)}
    # a step of a cold chunk alone returns before its graph ends: its device time says how long it ran
    assert result["by_kind"]["n cold graph"]["ms_p50"] == 24.1
    assert result["by_kind"]["decode graph + n cold graph"]["device_ms_p50"] == pytest.approx(7.8 + 32.6)
    assert result["by_kind"]["decode graph + n assembly graph + n cold graph"]["steps"] == 1
    assert result["longest"][0]["ms"] == 64.1 and result["longest"][0]["device_ms"] == (8.0, 20.8, 32.2)
    # the cold graph is each step's last part; the eager step after the phase is not counted
    assert result["cold_graph_device_ms"] == {"1-128": {"graphs": 1, "ms_p50": 22.0},
                                              "385-512": {"graphs": 2, "ms_p50": pytest.approx(32.4)}}


def _chunk(tokens: int, *, cached: bool = False, job: bool = False) -> SimpleNamespace:
    return SimpleNamespace(seq=SimpleNamespace(pic=SimpleNamespace(job=object() if job else None)),
                           chunk=SimpleNamespace(cached=("piece",) if cached else (), num_tokens=tokens))


def test_the_parser_reads_the_engines_own_step_line() -> None:
    """The log's format is the one the engine writes: two decodes, an assembly, a cold chunk."""
    batch = SimpleNamespace(chunks=[_chunk(1), _chunk(1), _chunk(70, cached=True), _chunk(300, job=True)],
                            num_decodes=2)
    held = _step_line(batch)
    step, = step_log.parse([f"DEBUG hypic: step 1: 41.0 ms, {held}; decode graph + 1 assembly graph + 1 cold graph: "
                            "0.3/4.0, 1.7/20.8, 1.3/30.2 ms, host/device"])
    assert held == "2 decodes, 1 assembly (70 tokens), 1 cold chunk (300 tokens)"
    assert step.tokens("cold chunk") == 300 and step.tokens("assembly") == 70 and step.tokens("decode") is None
    assert step.device_ms == (4.0, 20.8, 30.2) and step.kind == "decode graph + n assembly graph + n cold graph"


def test_a_lane_cold_graph_counts_no_device_time_and_is_no_lone_cold_graph() -> None:
    """A cold chunk on the cold lane: the step never waits for it, so the engine logs its host time alone."""
    launched = ModelRunner.launched.fget(SimpleNamespace(parts=SimpleNamespace(names=["lane cold graph",
                                                                                      "decode graph"])))
    assert launched == "decode graph + 1 lane cold graph"
    line = f"DEBUG hypic: step 2: 12.6 ms, 4 decodes, 1 cold chunk (480 tokens); {launched}: 0.3/9.8, 1.1 ms, host/device"
    step, = step_log.parse([line])
    assert step.device_ms == (9.8,) and step.kind == "decode graph + n lane cold graph"
    assert step_log.cold_graphs([step]) == {}


def test_a_missing_phase_start_says_so() -> None:
    with pytest.raises(SystemExit, match="no line matches"):
        step_log.phase(LOG.splitlines(), "never", None)
