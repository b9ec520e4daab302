"""scripts/eval_quality.py end to end on a tiny sample with the bundled model (CPU), and its helpers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from eval_quality import Setting, engine_groups, main, rotate_notes, settings_of  # noqa: E402

from hypic.data import KINDS, eval_prompts  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    torch.set_num_threads(1)  # the bundled model is tiny: one thread beats two contending ones
    prefix = tmp_path_factory.mktemp("quality") / "quality_cpu"
    result = main(["--device", "cpu", "--per-kind", "1", "--modes", "none,hypic", "--seam-widths", "8",
                   "--max-tokens", "2", "--ttft-samples", "1", "--segment-state-dtype", "bfloat16",
                   "--out-prefix", str(prefix)])
    return result, prefix


def test_json_has_both_settings_with_fractions_in_range(run: tuple[dict, Path]) -> None:
    result, prefix = run
    saved = json.loads((prefix.parent / "quality_cpu.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["device"] == "cpu" and saved["model"] == "default_model" and saved["date"] and saved["restate"]
    assert saved["segment_state_dtype"] == "bfloat16"
    assert [(e["mode"], e["seam_width"]) for e in saved["settings"]] == [("none", None), ("hypic", 8)]
    for entry in saved["settings"]:
        assert set(entry["em"]) == {*KINDS, "overall"} and entry["count"] == dict.fromkeys(KINDS, 1)
        assert all(0.0 <= value <= 1.0 for value in entry["em"].values())
        assert 0.0 <= entry["cached_fraction"] <= 1.0 and 0.0 <= entry["warm_cached_fraction"] <= 1.0
        for kind in ("cold", "warm"):
            assert entry["ttft_ms"][kind]["mean"] > 0 and entry["ttft_ms"][kind]["p50"] > 0


def test_cache_use_follows_the_mode(run: tuple[dict, Path]) -> None:
    none, hypic = run[0]["settings"]
    assert none["interior_hit_fraction"] is None and none["cached_fraction"] == 0.0  # none reads no cache
    assert 0.0 <= hypic["interior_hit_fraction"] <= 1.0
    assert hypic["warm_interior_hit_fraction"] == 1.0  # warm: every note was cached by the cold request
    assert hypic["warm_cached_fraction"] > 0.5


def test_markdown_and_plots_are_written(run: tuple[dict, Path]) -> None:
    prefix = run[1]
    table = (prefix.parent / "quality_cpu.md").read_text()
    assert "| setting | lookup | two_hop | linked | long | overall |" in table
    assert "\n| none |" in table and "\n| hypic w=8 |" in table
    for name in ("quality_cpu_ttft.png", "quality_cpu_seam.png"):
        data = (prefix.parent / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_settings_and_engine_groups() -> None:
    settings = settings_of(["none", "naive", "hypic"], [4, 8])
    assert settings == [Setting("none", None), Setting("naive", None), Setting("hypic", 4), Setting("hypic", 8)]
    assert engine_groups(settings, [4, 8]) == {4: settings[:3], 8: settings[3:]}


def test_rotated_prompt_keeps_the_notes_and_changes_the_prefix() -> None:
    prompt = eval_prompts(1)[0]
    moved = rotate_notes(prompt)
    assert sorted(moved.notes) == sorted(prompt.notes) and moved.notes[0] != prompt.notes[0]
    assert (moved.segments[0], moved.segments[-1], moved.qas) == (prompt.segments[0], prompt.segments[-1], prompt.qas)


@pytest.mark.parametrize("bad", [["--modes", "none,fast"], ["--seam-widths", "8,-1"], ["--per-kind", "0"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(bad)
