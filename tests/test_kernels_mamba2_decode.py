"""The fused Mamba2 decode step (conv window, dt, SSD recurrence, D skip, grouped gated norm in two
kernels): the mixer's plain-decode path (its torch reference) against the mixer's unfused path, which
test_models_mamba2 checks against transformers; the Triton kernels against the reference over two steps
(outputs, float32 states, conv windows), with padding rows on a shared scratch slot, n_groups 1 and 2,
dt clamped and not, float32 and bfloat16 activations; both kernels compiled for sm90 without spills;
and a tiny Nemotron-H engine's greedy decode on CUDA with and without the fused step. Triton runs on
CUDA, or on the CPU through the interpreter on request."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from hypic.kernels.mamba2_decode import mamba2_decode_ref, mamba2_decode_triton
from hypic.models.batch import ForwardBatch
from hypic.models.mamba2 import Mamba2Mixer
from hypic.models.mamba2_config import Mamba2HybridConfig
from hypic.models.mixer import LinearMixer

import mamba2_models
from engine_util import greedy
from kernel_cases import interpreted, rel_err
from pic_util import DOCS, engine_run, logprobs, prompt

HEADS, HEAD_DIM, STATE, WIDTH, SLOTS, SCRATCH = 4, 24, 12, 4, 6, 5  # head_dim and d_state off the tiles
SLOT_ROWS, HAS_STATE = torch.tensor([4, 0, 2, SCRATCH, SCRATCH]), torch.tensor([True, False, True, True, True])
REAL = 3  # rows after these pad a captured step: all on the scratch slot, whose contents are anyone's
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
UNCLAMPED, CLAMPED = (0.0, float("inf")), (0.3, 0.9)  # time_step_limit; dt is in [0.3, 1.3]
CASES = [pytest.param(1, UNCLAMPED, torch.float32, id="1group-fp32"),  # (n_groups, time_step_limit, activations)
         pytest.param(2, CLAMPED, torch.bfloat16, id="2groups-clamped-bf16"),
         pytest.param(2, CLAMPED, torch.float32, id="2groups-clamped-fp32"),
         pytest.param(1, UNCLAMPED, torch.bfloat16, id="1group-bf16")]
KERNEL_CASES = CASES[:2]  # the interpreter is slow: one group in float32, two in bf16 clamped
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
REPO = Path(__file__).resolve().parents[1]
GRANITE_SMALL = {"heads": 128, "head_dim": 64, "state": 128, "groups": 1, "width": 4}  # one group of 8192 channels


def make_mixer(groups: int, limit: tuple[float, float], dtype: torch.dtype, gen: torch.Generator) -> Mamba2Mixer:
    """A Nemotron-H mixer with random weights; A_log, dt_bias and D float32 as the loader keeps them."""
    config = Mamba2HybridConfig.from_dict({
        "model_type": "nemotron_h", "vocab_size": 32, "hidden_size": 32, "num_attention_heads": 2,
        "hybrid_override_pattern": "M", "mamba_num_heads": HEADS, "mamba_head_dim": HEAD_DIM,
        "ssm_state_size": STATE, "n_groups": groups, "conv_kernel": WIDTH, "time_step_limit": limit})
    mixer = Mamba2Mixer(config)
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if "proj" in name else 1.0))
        mixer.dt_bias.copy_(torch.rand(HEADS, generator=gen) * 2 - 1)  # dt in [0.3, 1.3]
        mixer.norm.weight.add_(1.0)
    for name, param in mixer.named_parameters():
        if name not in ("A_log", "dt_bias", "D"):
            param.data = param.data.to(dtype)
    return mixer


def pools(mixer: Mamba2Mixer, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random slots; the fresh sequence's slot holds NaN (a recycled slot must not leak into it)."""
    ssm = torch.randn(SLOTS, *mixer.shape.state_shape, generator=gen)
    conv = torch.randn(SLOTS, *mixer.shape.conv_state_shape, generator=gen).to(dtype)
    fresh = SLOT_ROWS[~HAS_STATE]
    ssm[fresh], conv[fresh] = float("nan"), float("nan")
    return ssm, conv


def decode_batch(slots: torch.Tensor, has_state: torch.Tensor) -> ForwardBatch:
    """A plain decode step of len(slots) sequences (what a Mamba2 mixer reads of it)."""
    n, zeros = len(slots), torch.zeros(len(slots), dtype=torch.long)
    return ForwardBatch(input_ids=zeros, positions=zeros, cu_seqlens=torch.arange(n + 1, dtype=torch.int32),
                        slots=slots, has_state=has_state, block_tables=torch.zeros(n, 1, dtype=torch.int32),
                        kv_lens=torch.ones(n, dtype=torch.int32), kv_write_slots=zeros, logits_indices=torch.arange(n),
                        num_decodes=n, seq_lens_cpu=(1,) * n, kv_lens_cpu=(1,) * n, max_kv_len=1)


def assert_slots_match(actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor],
                       tolerance: float) -> None:
    """States close, windows equal (inputs moved, not computed), over the real rows' slots."""
    real = SLOT_ROWS[:REAL]
    assert rel_err(actual[0][real].cpu(), expected[0][real]) <= tolerance
    assert torch.equal(actual[1][real].cpu(), expected[1][real])


@pytest.mark.parametrize("groups,limit,dtype", CASES)
def test_plain_decode_matches_the_unfused_mixer(groups: int, limit: tuple[float, float], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(groups)
    mixer = make_mixer(groups, limit, dtype, gen)
    unfused = pools(mixer, dtype, gen)
    fused = tuple(t.clone() for t in unfused)
    batch = decode_batch(SLOT_ROWS, HAS_STATE)
    for step in range(2):
        hidden = torch.randn(len(SLOT_ROWS), 32, generator=gen).to(dtype)
        with torch.no_grad():
            expected = LinearMixer.shared_path(mixer, hidden, batch, *unfused, 0)
            actual = mixer(hidden, batch, *fused, 0)
        assert torch.equal(actual[:REAL], expected[:REAL]), step
        assert_slots_match(fused, unfused, 0.0)
        batch = decode_batch(SLOT_ROWS, torch.ones(len(SLOT_ROWS), dtype=torch.bool))  # all continue


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups,limit,dtype", KERNEL_CASES)
def test_fused_kernels_match_reference(device: str, groups: int, limit: tuple[float, float], dtype: torch.dtype,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu_mixer, mixer = (make_mixer(groups, limit, dtype, torch.Generator().manual_seed(groups)) for _ in range(2))
    layers = cpu_mixer.decode_layer(), mixer.to(device).decode_layer()
    gen = torch.Generator().manual_seed(10 + groups)
    ref = pools(mixer, dtype, gen)
    on = tuple(t.clone().to(device) for t in ref)
    has_state = HAS_STATE
    for step in range(2):
        hidden = torch.randn(len(SLOT_ROWS), 32, generator=gen).to(dtype)
        with torch.no_grad():
            xbc, (z, dt) = mixer.project(hidden.to(device))  # column views of one projection
            expected = mamba2_decode_ref(xbc.cpu(), z.cpu(), dt.cpu(), layers[0], *ref, SLOT_ROWS, has_state)
            out = mamba2_decode_triton(xbc, z, dt, layers[1], *on, SLOT_ROWS.to(device), has_state.to(device))
        assert rel_err(out[:REAL].cpu(), expected[:REAL]) <= TOLERANCE[dtype], step
        assert_slots_match(on, ref, TOLERANCE[dtype])
        has_state = torch.ones(len(SLOT_ROWS), dtype=torch.bool)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="compiling for sm90 needs triton")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")
@pytest.mark.parametrize("tokens,shape", [(16, None), (1, GRANITE_SMALL)], ids=["nemotron3-nano", "granite4-h"])
def test_fused_kernels_compile_for_hopper_without_spills(tokens: int, shape: dict[str, int] | None) -> None:
    """No GPU needed: Nemotron 3 Nano's heads at a batch of wide value blocks, and Granite-4.0-H's single
    group, whose norm program takes a whole 8192-channel row."""
    spec = importlib.util.spec_from_file_location("kernel_resources", REPO / "scripts" / "kernel_resources.py")
    resources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resources)
    compiled = resources.compile_mamba2_decode(tokens, shape or resources.MAMBA2_SHAPE)
    usage = {name: resources.resource_usage(kernel) for name, kernel in compiled.items()}
    assert set(usage) == {"_ssd_step_kernel", "_group_norm_kernel"}
    assert all(" STACK:0 " in line for line in usage.values()), usage


@pytest.mark.gpu
def test_nemotron_engine_decodes_alike_with_and_without_the_fused_step(tmp_path, monkeypatch) -> None:
    """Greedy decode (CUDA graphs, float32) of a tiny Nemotron-H: the fused step against the mixer's shared path."""
    model_dir = mamba2_models.make_model_dir(tmp_path, "nemotron_h", slow_decay=True, mamba_head_dim=16)
    jobs = [(prompt(*DOCS), greedy(12, logprobs=0)), ("hello world, the quick brown fox", greedy(9, logprobs=0))]
    fused = engine_run(model_dir, "cuda", jobs, cache_mode="none")
    monkeypatch.setattr(Mamba2Mixer, "forward", LinearMixer.shared_path)
    unfused = engine_run(model_dir, "cuda", jobs, cache_mode="none")
    for fused_outs, unfused_outs in zip(fused, unfused):
        for f, u in zip(fused_outs, unfused_outs):
            assert f.tokens == u.tokens
            assert logprobs(f) == pytest.approx(logprobs(u), abs=1e-3)
