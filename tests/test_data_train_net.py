"""The training-side model and loop (scripts/train/train_*.py) against transformers and a plain recurrence."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "train"
sys.path.insert(0, str(SCRIPTS))

from make_default_model import model_config  # noqa: E402
from train_data import init_worker, make_group  # noqa: E402
from train_model import SMOKE_DIMS, Checkpoint, answer_loss, run_over, to_device  # noqa: E402
from train_net import Qwen35ForTraining, chunked_delta_rule  # noqa: E402

MODEL_DIR = SCRIPTS.parents[1] / "hypic" / "assets" / "default_model"


def tiny_config() -> dict:
    cfg = model_config(300)
    cfg.update(SMOKE_DIMS, num_hidden_layers=4)
    return cfg


def naive_delta_rule(q, k, v, g, beta):
    """Token-by-token S_t = e^g (I - b k k^T) S + b k v^T, o_t = S_t^T q_t, in float64."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    state = q.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])
    out = []
    for t in range(k.shape[2]):
        kt, vt = k[:, :, t], v[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        state = state - beta[:, :, t, None, None] * kt[..., None] * (kt[..., None, :] @ state)
        state = state + beta[:, :, t, None, None] * kt[..., None] * vt[..., None, :]
        out.append((q[:, :, t, None, :] @ state).squeeze(-2))
    return torch.stack(out, 2)


@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_delta_rule_matches_the_recurrence(chunk: int) -> None:
    torch.manual_seed(0)
    b, h, t, d = 2, 3, 32, 8
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, t, d), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(b, h, t, d), -torch.rand(b, h, t) * 2, torch.rand(b, h, t)
    got = chunked_delta_rule(q, k, v, g, beta, chunk)
    torch.testing.assert_close(got.double(), naive_delta_rule(q, k, v, g, beta), atol=1e-4, rtol=1e-4)


def test_training_model_matches_transformers_logits() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config()
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)  # non-trivial norm weights
    net = Qwen35ForTraining(cfg, chunk=8)
    net.load_state_dict({n: t for n, t in hf.state_dict().items() if n != "lm_head.weight"})
    ids = torch.randint(0, 300, (2, 37))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
        positions = torch.tensor([3, 40, 73])
        torch.testing.assert_close(net(ids, positions), net(ids).reshape(-1, 300)[positions])


def test_one_step_learns_and_the_checkpoint_round_trips(tmp_path: Path) -> None:
    init_worker(str(MODEL_DIR / "tokenizer.json"))
    batch = make_group(0, seed=0, group=0, token_budget=1024, multiple=16)[0]
    assert batch.ids.shape[1] % 16 == 0 and len(batch.targets) == len(batch.positions) > 0
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    cfg.update(SMOKE_DIMS, num_hidden_layers=4)
    torch.manual_seed(0)
    net = Qwen35ForTraining(cfg, chunk=16)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    b = to_device(batch, torch.device("cpu"))
    losses = []
    for _ in range(3):
        loss, correct = answer_loss(net, b, torch.device("cpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and correct.shape == b["kinds"].shape
    Checkpoint(tmp_path).save(net, opt, {"step": 3}, {"points": []})
    assert all(f.stat().st_size < 16 << 20 for f in tmp_path.iterdir())
    fresh = Qwen35ForTraining(cfg, chunk=16)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    state, _ = Checkpoint(tmp_path).load(fresh, fresh_opt)
    assert state["step"] == 3
    for (name, p), q in zip(net.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p.detach().to(torch.bfloat16).float(), msg=name)
    fresh_opt.step()  # the restored optimizer state is usable


def test_a_run_stops_at_its_time_or_step_limit() -> None:
    """--max-steps 0 means no step limit (a run with it once stopped before its first step)."""
    from argparse import Namespace

    unlimited = Namespace(smoke=False, time_limit=540.0, max_steps=0)
    three = Namespace(smoke=False, time_limit=540.0, max_steps=3)
    assert not run_over(unlimited, 0, 10.0) and not run_over(unlimited, 10**6, 10.0)
    assert run_over(unlimited, 0, 500.0)  # 45 s are kept for the final evaluation and save
    assert not run_over(three, 2, 10.0) and run_over(three, 3, 10.0)
