"""scripts/train/train_model.py data parallel under torchrun: two CPU ranks (gloo), fresh start and resume."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train" / "train_model.py"


def torchrun(ckpt: Path, *flags: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPT), "--ckpt", str(ckpt), "--smoke", "--max-steps", "3", "--time-limit", "110", *flags]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_two_ranks_train_one_model_and_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = torchrun(ckpt)
    assert first.count("device cpu x2") == 1  # rank 0 alone logs
    assert "replicas: max |weight - rank 0's| = 0\n" in first
    state = json.loads((ckpt / "state.json").read_text())
    assert state["runs"] == 1 and state["step"] == 3  # --max-steps
    second = torchrun(ckpt, "--stage", "1")
    assert "resumed=True" in second and "'stage': 1, " in second and "'stage_step': 0" in second
    assert "replicas: max |weight - rank 0's| = 0\n" in second
    resumed = json.loads((ckpt / "state.json").read_text())
    assert resumed["runs"] == 2 and resumed["step"] == 6 and resumed["group"] > state["group"]
