"""scripts/bench_tiers.py end to end on the bundled model (CPU), in the two calls a short GPU lease
takes: a run of every part killed in qps (simulated: qps raises) keeps the parts it finished, and a
later run of disk and qps merges into that file. Every tier's TTFT is served from that tier, the
target is computed from the figures beside it, and both corpus sweeps ran against their own server
(no timings are asserted)."""
from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_tiers  # noqa: E402

from hypic.bench.report import measured_by  # noqa: E402
from hypic.engine.llm_engine import LLMEngine  # noqa: E402

RATES = [4.0, math.inf]
OPTIONS = ["--device", "cpu", "--prompts", "2x64", "--repeats", "1", "--corpus-factor", "2",
           "--qps-doc-tokens", "64", "--qps-rates", "4,inf", "--qps-requests", "3"]


def killed(*args: object) -> None:
    raise KeyboardInterrupt("the lead's timeout")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    """(the file after the killed run, the second run's result, the file after it)."""
    torch.set_num_threads(1)  # the bundled model is tiny: one thread beats two contending ones
    out = tmp_path_factory.mktemp("tiers") / "tiers_cpu.json"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(bench_tiers, "corpus_qps", killed)
        bench_tiers.main([*OPTIONS, "--out", str(out)])
    partial = json.loads(out.read_text())
    result = bench_tiers.main([*OPTIONS, "--parts", "disk,qps", "--out", str(out)])
    return partial, result, json.loads(out.read_text())


def test_the_corpus_is_sized_from_the_layout_the_engine_has() -> None:
    config, model = bench_tiers.engine_config(bench_tiers.parse_args(["--device", "cpu"]), None)
    assert bench_tiers.segment_layout(config, model) == LLMEngine(config).store.layout


def test_a_killed_run_keeps_the_parts_it_finished(runs: tuple[dict, dict, dict]) -> None:
    partial, _, _ = runs
    [run] = partial["runs"]
    assert run["requested"] == ["copy", "ttft", "disk", "qps_host", "qps_pool"]
    assert list(run["measured"]) == ["copy", "ttft", "disk"] and set(partial["parts"]) == {"copy", "ttft", "disk"}
    assert partial["parts"]["ttft"]["settings"]["disk_tier"]  # the disk part read what ttft's engine wrote


def test_a_run_of_some_parts_replaces_those_and_keeps_the_others(runs: tuple[dict, dict, dict]) -> None:
    partial, _, saved = runs
    first, second = saved["runs"]
    assert list(first["measured"]) == ["copy", "ttft"] and list(second["measured"]) == ["disk", "qps_host", "qps_pool"]
    assert list(saved["parts"]) == ["copy", "ttft", "disk", "qps_host", "qps_pool"]  # run order, not the order written
    assert saved["parts"]["copy"] == partial["parts"]["copy"] and saved["parts"]["ttft"] == partial["parts"]["ttft"]
    when = {name: datetime.datetime.fromisoformat(measured_by(saved, name)["date"]) for name in saved["parts"]}
    assert when["copy"] == when["ttft"] < when["disk"] == when["qps_host"] == when["qps_pool"]
    assert saved["date"] == second["date"] and saved["device"] == "cpu" and second["measured"]["disk"] > 0


def test_each_tier_figure_was_served_from_that_tier(runs: tuple[dict, dict, dict]) -> None:
    partial, _, saved = runs
    served = saved["parts"]["ttft"]["prompts"]["2x64"]["served_from"]
    assert set(served["pool"]) == {"pic"} and set(served["host"]) == {"pic_host"} and "pic" not in served["none"]
    assert served["pool"]["pic"] == served["host"]["pic_host"] > 0
    assert saved["parts"]["ttft"]["host_stats"]["hits"] > 0
    for disk in (partial["parts"]["disk"], saved["parts"]["disk"]):  # written by ttft's engine, by its own
        stats, sets = disk["disk_stats_after_restart"], disk["settings"]["repeats"] + 1
        assert stats["hits"] + stats["recomputed"] == 2 * sets and stats["errors"] == 0  # each document, read or not
        if stats["recomputed"] == 0:  # read, as ReadOrRecompute found cheaper
            assert disk["prompts"]["2x64"]["served_from"] == {"pic_disk": served["pool"]["pic"]}


def test_the_disk_part_has_a_cold_column_traces_and_the_rates_it_started_from(runs: tuple[dict, dict, dict]) -> None:
    _, _, saved = runs
    disk = saved["parts"]["disk"]
    rates, sets = disk["rates_at_start"], disk["settings"]["repeats"] + 1
    assert rates["read_bytes_per_s"] > 0 and rates["prefill_tokens_per_s"] > 0 and rates["read_rate"] == "kept"
    figures = disk["prompts"]["2x64"]
    assert figures["cold"] > 0 and figures["disk"] > 0
    for tier in ("disk", "cold"):
        traces = figures["traces"][tier]
        assert [t["measured"] for t in traces] == [False] + [True] * (sets - 1)
        for t in traces:  # every interval charged once
            assert sum(t[part] for part in bench_tiers.TRACED) == pytest.approx(t["ttft_s"])
            assert t["pinned_allocations"] == 0 and t["late"] <= t["read"]
    assert all(t["read"] + t["recomputed"] == 2 for t in figures["traces"]["disk"])  # each document, read or not
    assert all(t["read"] == t["recomputed"] == t["read_s"] == 0 for t in figures["traces"]["cold"])


def test_the_target_is_computed_from_the_figures_beside_it(runs: tuple[dict, dict, dict]) -> None:
    _, _, saved = runs
    figures, rate = saved["parts"]["ttft"]["prompts"]["2x64"], saved["parts"]["ttft"]["host_to_device_bytes_per_s"]
    assert rate == saved["parts"]["copy"]["copy_bytes_per_s"]["host_to_device"]  # measured by the same run
    budget = figures["pool"] + figures["entry_bytes"] / rate + 3e-3
    assert figures["host_budget"] == pytest.approx(budget)
    assert figures["host_within_budget"] == (figures["host"] <= budget)
    assert figures["host_over_none"] == pytest.approx(figures["host"] / figures["none"])
    assert figures["host_within_20pct_of_none"] == (figures["host"] <= 0.2 * figures["none"])
    assert figures["target_met"] == figures["host_within_budget"]  # the 20 % applies at 4 x 4k only


def test_both_corpus_sweeps_ran_every_rate_against_their_own_tiers(runs: tuple[dict, dict, dict]) -> None:
    _, result, saved = runs
    for name in ("qps_host", "qps_pool"):
        qps = saved["parts"][name]
        assert qps["documents"] == math.ceil(2 * qps["settings"]["pool_bytes"] / qps["entry_bytes"])
        assert [p["request_rate"] for p in result["parts"][name]["series"]["points"]] == RATES
        assert all(p["completed"] == 3 and p["errors"] == 0 for p in qps["series"]["points"])
        assert qps["workload"]["documents"] == qps["documents"]
    assert saved["parts"]["qps_host"]["admin_cache"]["segment_host"]["hits"] > 0
    assert saved["parts"]["qps_pool"]["admin_cache"]["segment_host"] is None
