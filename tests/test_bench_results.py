"""Result files built across short GPU calls (hypic.bench.report's ResultFile, made by scripts/results.py's
grouped_result), through the scripts' CPU smoke paths on the bundled model: bench_pic killed mid-run leaves a readable file of what it
measured, a later run of other groups merges into it (derived figures recomputed from both runs'),
a run of another setup is refused before it builds anything; bench_fidelity's segment counts merge
the same way; bench_engine's derived figures follow the merged raw ones. No timings are asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_engine  # noqa: E402
import bench_fidelity  # noqa: E402
import bench_pic  # noqa: E402
import results  # noqa: E402

from hypic.bench.report import MismatchedResults, measured_by, with_group  # noqa: E402
from hypic.engine.setup import BUNDLED_MODEL  # noqa: E402

PIC = ["--model", str(BUNDLED_MODEL), "--count-len", "32", "--repeats", "1"]


def interrupted_after(calls: int, measure):
    """bench_pic.measure that is killed (the lead's timeout) on call number `calls + 1`."""
    count = 0

    def measured(*args: object, **kwargs: object) -> dict:
        nonlocal count
        count += 1
        if count > calls:
            raise KeyboardInterrupt("the call's time limit")
        return measure(*args, **kwargs)
    return measured


@pytest.fixture(scope="module")
def pic_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    """(the file after a run killed in its third group, the file after a second run, the path)."""
    torch.set_num_threads(1)  # the bundled model is tiny: one thread beats two contending ones
    out = tmp_path_factory.mktemp("pic") / "pic_cpu.json"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(bench_pic, "measure", interrupted_after(3, bench_pic.measure))  # the warm-up and two groups
        bench_pic.main([*PIC, "--lengths", "32", "--counts", "2,3", "--overhead", "", "--out", str(out)])
    partial = json.loads(out.read_text())
    bench_pic.main([*PIC, "--lengths", "", "--counts", "3", "--overhead", "2x32", "--out", str(out)])
    return partial, json.loads(out.read_text()), out


def test_a_killed_run_leaves_a_readable_file_of_what_it_measured(pic_runs: tuple[dict, dict, Path]) -> None:
    partial, _, out = pic_runs
    [run] = partial["runs"]
    assert run["requested"] == ["by_length 4x32", "by_count 2x32", "by_count 3x32"]
    assert list(run["measured"]) == ["by_length 4x32", "by_count 2x32"]
    assert list(partial["by_length"]) == ["4x32"] and list(partial["by_count"]) == ["2x32"]
    assert "marginal_ms_per_segment_hypic" not in partial  # one count: no slope yet
    assert not out.with_name(out.name + ".partial").exists()


def test_a_later_run_keeps_the_groups_it_did_not_measure(pic_runs: tuple[dict, dict, Path]) -> None:
    partial, merged, _ = pic_runs
    first, second = merged["runs"]
    assert first == partial["runs"][0] and list(second["measured"]) == ["by_count 3x32", "tuple overhead"]
    assert merged["by_length"] == partial["by_length"]
    assert merged["by_count"]["2x32"] == partial["by_count"]["2x32"] and list(merged["by_count"]) == ["2x32", "3x32"]
    assert measured_by(merged, "by_count 2x32") == first and measured_by(merged, "tuple overhead") == second
    assert merged["date"] == second["date"] and merged["command"] == second["command"]
    assert merged["tuple_overhead_prompt"] == "2x32" and merged["tuple_overhead_fraction"] > -1.0


def test_derived_figures_come_from_both_runs(pic_runs: tuple[dict, dict, Path]) -> None:
    _, merged, _ = pic_runs
    two, three = merged["by_count"]["2x32"], merged["by_count"]["3x32"]  # measured by the first and second run
    for mode in ("none", "hypic"):
        assert merged[f"marginal_ms_per_segment_{mode}"] == pytest.approx((three[mode] - two[mode]) * 1e3)
    for kind in bench_pic.KINDS:
        assert merged["speedup_hypic_over_none"][kind] == {
            name: pytest.approx(t["none"] / t["hypic"]) for name, t in merged[kind].items()}


def test_a_run_of_another_setup_is_refused_and_changes_nothing(pic_runs: tuple[dict, dict, Path]) -> None:
    _, _, out = pic_runs
    before = out.read_bytes()
    with pytest.raises(MismatchedResults) as refused:
        bench_pic.main([*PIC, "--seam-width", "4", "--out", str(out)])
    assert refused.value.differing == {"seam_width": (8, 4)} and "seam_width" in str(refused.value)
    assert out.read_bytes() == before


def test_a_file_written_before_results_could_merge_is_refused(tmp_path: Path) -> None:
    old = tmp_path / "pic_cpu.json"
    old.write_text(json.dumps({"benchmark": "pic", "by_length": {}}))
    with pytest.raises(MismatchedResults) as refused:
        results.grouped_result(old, {"benchmark": "pic"}, ["by_length 4x32"])
    assert set(refused.value.differing) == {"runs"}


def test_pic_draws_token_ids_inside_a_small_vocabulary(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "pic_cpu.json"  # the tiny checkpoint has 300 ids, far below the 3000 of a shape's prompts
    bench_pic.main(["--model", str(tiny_model_dir), "--count-len", "16", "--repeats", "1", "--lengths", "",
                    "--counts", "2", "--overhead", "", "--out", str(out)])
    assert set(json.loads(out.read_text())["by_count"]["2x16"]) == {"none", "prefix", "hypic", "hypic_cold", "hypic_repeat"}


def test_fidelity_segment_counts_merge(tmp_path: Path) -> None:
    out, options = tmp_path / "fidelity_cpu.json", ["--segment-len", "32", "--out"]
    bench_fidelity.main(["--segments", "2", *options, str(out)])
    bench_fidelity.main(["--segments", "4", *options, str(out)])
    saved = json.loads(out.read_text())
    assert [list(run["measured"]) for run in saved["runs"]] == [["segments 2"], ["segments 4"]]
    for n in ("2", "4"):
        for mode in ("hypic", "naive"):
            assert set(saved["segments"][n][mode]) == {"first", "deepest"}


def test_engine_fractions_of_peak_follow_the_merged_prefill_figures(tmp_path: Path) -> None:
    config, out = bench_engine.shape_config("kimi_linear_48b", 32768), tmp_path / "engine.json"
    header = {"benchmark": "engine", "shape": "kimi_linear_48b"}
    runs = [{("hypic", "prefill", "16384"): 2.0e4, ("transformers", "decode", "1"): 10.0},
            {("hypic", "prefill", "4096"): 3.0e4, ("hypic", "decode", "1"): 100.0, ("hypic", "decode_floor", "1"): 400.0}]
    for i, figures in enumerate(runs):
        record = results.grouped_result(out, header, [f"run {i}"], finish=lambda data: bench_engine.derive(config, data))
        record.write(with_group(record.part, f"run {i}", figures, 1.0))
    saved = json.loads(out.read_text())
    assert list(saved["hypic"]["prefill"]) == ["4096", "16384"]
    assert saved["prefill_fraction_of_bf16_peak"] == {
        n: pytest.approx(tps * bench_engine.flops_per_token(config, int(n)) / bench_engine.H200_BF16_FLOPS)
        for n, tps in saved["hypic"]["prefill"].items()}
    assert saved["speedup_over_transformers"] == {"prefill": {}, "decode": {"1": pytest.approx(10.0)}}


def test_every_committed_result_parses_and_says_when_and_how():
    """A later run merges into the committed file, so a hand-edited one must still be JSON; the file
    (or each of its labelled runs) names its date and command."""
    files = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        runs = [data] if "date" in data else list(data["runs"].values())  # labelled runs: {label: run}
        assert all(run.get("date") and run.get("command") for run in runs), path.name
