"""The fused KDA decode step (three short-conv windows, q/k l2norm, per-key gates and beta, recurrence,
sigmoid-gated norm in one kernel) against its torch reference, the unfused references in turn: outputs,
states and conv windows over two steps (the kernel's counters must be back at zero after the first),
with padding rows sharing a scratch slot as a CUDA graph's do; and a KDA mixer's fused decode against
its unfused path (conv, operands, recurrence, output each on their own, which the model tests check
against transformers). Triton runs on CUDA, or on the CPU through the interpreter on request; the
kernel also compiles for sm90 at Kimi-Linear-48B's heads on any machine with triton."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import kimi_models
from hypic.kernels import kda_decode
from hypic.kernels.kda_decode import KdaDecodeLayer, kda_decode_ref, kda_decode_triton
from hypic.kernels.triton_lazy import bind_module
from hypic.models import kda
from hypic.models.batch import ForwardBatch
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.mixer import LinearMixer
from kernel_cases import interpreted, rel_err

HEADS, HEAD_DIM, WIDTH, SLOTS = 2, 24, 4, 7  # 24 channels: two value blocks a head, masked key lanes
QKV = 3 * HEADS * HEAD_DIM
SCRATCH = 6  # the padding rows' slot
SLOT_ROWS, PADS = torch.tensor([4, 0, 2]), 2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]


def step_inputs(tokens: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """qkv, b, f, gate as column views of one [tokens, 3 H K + H + 2 H K + 3] projection."""
    widths = (QKV, HEADS, HEADS * HEAD_DIM, HEADS * HEAD_DIM, 3)
    proj = (torch.randn(tokens, sum(widths), generator=gen) * 1.5).to(dtype)
    qkv, b, f, gate, _ = proj.split(widths, dim=1)
    return qkv, b, f, gate.unflatten(1, (HEADS, HEAD_DIM))


def layer_on(device: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[KdaDecodeLayer, KdaDecodeLayer]:
    """A layer's decode weights on the CPU and on `device`; gates spread over exp(g) ~ 0.1 .. 1."""
    weights = [torch.randn(QKV, WIDTH, generator=gen).to(dtype), torch.rand(HEADS, generator=gen) * 2 - 2,
               torch.randn(HEADS * HEAD_DIM, generator=gen),
               (1 + 0.3 * torch.randn(HEAD_DIM, generator=gen)).to(dtype)]
    shape = (1e-5, HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    return KdaDecodeLayer(*weights, *shape), KdaDecodeLayer(*(w.to(device) for w in weights), *shape)


def random_pools(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """State and conv slabs; slot 0 (a fresh sequence's) holds NaN, which must not leak into it."""
    ssm = torch.randn(SLOTS, HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
    conv = torch.randn(SLOTS, QKV, WIDTH - 1, generator=gen).to(dtype)
    ssm[0], conv[0] = float("nan"), float("nan")
    return ssm, conv


def padded(slots: torch.Tensor, has_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real rows, then PADS rows decoding into the scratch slot (with state, as a graph's pad rows)."""
    return (torch.cat([slots, torch.full((PADS,), SCRATCH)]),
            torch.cat([has_state, torch.ones(PADS, dtype=torch.bool)]))


def assert_matches(out, pools, expected, expected_pools, dtype: torch.dtype, step: int) -> None:
    """Real rows' outputs and their slots' states and windows (the scratch slot's are undefined)."""
    real = len(SLOT_ROWS)
    assert rel_err(out[:real].cpu(), expected[:real]) <= TOLERANCE[dtype], step
    assert rel_err(pools[0].cpu()[SLOT_ROWS], expected_pools[0][SLOT_ROWS]) <= TOLERANCE[dtype], step
    assert torch.equal(pools[1].cpu()[SLOT_ROWS], expected_pools[1][SLOT_ROWS]), step  # inputs moved, not computed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_matches_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(5)
    layers = layer_on(device, dtype, gen)
    slots, has_state = padded(SLOT_ROWS, torch.tensor([True, False, True]))
    ssm, conv = random_pools(dtype, gen)
    pools = [(ssm.clone(), conv.clone()), (ssm.to(device), conv.to(device))]
    for step in range(2):
        inputs = step_inputs(len(slots), dtype, gen)
        expected = kda_decode_ref(*inputs, layers[0], *pools[0], slots, has_state)
        on = [t.to(device) for t in inputs]
        out = kda_decode_triton(*on, layers[1], *pools[1], slots.to(device), has_state.to(device))
        assert_matches(out, pools[1], expected, pools[0], dtype, step)
        has_state = torch.ones(len(slots), dtype=torch.bool)  # the second step continues every sequence


def kda_mixer(dtype: torch.dtype, gen: torch.Generator) -> kda.KimiDeltaAttention:
    """A KDA layer of the test shape with random weights (norm weight and gates off their defaults)."""
    linear = {**kimi_models.COMMON["linear_attn_config"], "num_heads": HEADS, "head_dim": HEAD_DIM}
    config = KimiLinearConfig.from_dict({**kimi_models.COMMON, "model_type": "kimi_linear",
                                         "linear_attn_config": linear})
    mixer = kda.KimiDeltaAttention(config)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.5 if param.dim() == 1 else 0.2))
        mixer.A_log.copy_(torch.rand(HEADS, generator=gen) * 2 - 2)
        mixer.o_norm.weight.add_(1.0)
    for name, param in mixer.named_parameters():  # the decay parameters stay float32, as the loader keeps them
        if name not in ("A_log", "dt_bias"):
            param.data = param.data.to(dtype)
    return mixer


def decode_batch(slots: torch.Tensor, has_state: torch.Tensor) -> ForwardBatch:
    """A plain decode step over slots (the fields a linear mixer reads; attention's are placeholders)."""
    n, on = len(slots), {"device": slots.device}
    zeros = torch.zeros(n, dtype=torch.long, **on)
    return ForwardBatch(input_ids=zeros, positions=zeros, cu_seqlens=torch.arange(n + 1, dtype=torch.int32, **on),
                        slots=slots, has_state=has_state, block_tables=torch.zeros(n, 1, dtype=torch.int32, **on),
                        kv_lens=torch.ones(n, dtype=torch.int32, **on), kv_write_slots=zeros,
                        logits_indices=torch.arange(n, **on), num_decodes=n, seq_lens_cpu=(1,) * n,
                        kv_lens_cpu=(1,) * n, max_kv_len=1)


@pytest.mark.parametrize("kernel", ["reference", pytest.param("interpreted", marks=interpreted),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixer_fused_decode_matches_its_unfused_path(kernel: str, dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path on the CPU is the reference (the model tests run it); the interpreter runs the kernel."""
    if kernel == "interpreted":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(kda, "kda_decode", kda_decode_triton)
    device = "cuda" if kernel == "cuda" else "cpu"
    gen = torch.Generator().manual_seed(6)
    mixer = kda_mixer(dtype, gen).to(device)
    slots, has_state = padded(SLOT_ROWS, torch.tensor([True, False, True]))
    batch = decode_batch(slots.to(device), has_state.to(device))
    ssm, conv = random_pools(dtype, gen)
    fused_pools, unfused_pools = ((ssm.clone().to(device), conv.clone().to(device)) for _ in range(2))
    hidden = torch.randn(len(slots), mixer.in_proj.in_features, generator=gen).to(device, dtype)
    with torch.no_grad():
        fused = mixer(hidden, batch, *fused_pools, 0)
        unfused = LinearMixer.shared_path(mixer, hidden, batch, *unfused_pools, 0)
    assert_matches(fused, fused_pools, unfused.cpu(), [p.cpu() for p in unfused_pools], dtype, 0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="compiling for sm90 needs triton")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")
@pytest.mark.parametrize("block_v", [16, 32])  # decode_launch's value blocks below and from 16 sequences
@pytest.mark.parametrize("activation", ["bf16", "fp32"])
def test_fused_step_compiles_for_hopper_at_kimi_heads(block_v: int, activation: str) -> None:
    """No GPU needed: what the interpreter lets through (types, pointer arithmetic) the compiler must too,
    without spilling."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "kernel_resources.py"
    spec = importlib.util.spec_from_file_location("kernel_resources", path)
    resources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resources)
    kernel = bind_module(vars(kda_decode))["_kda_decode_step_kernel"]
    pointers = {n: f"*{activation}" for n in ("x", "b", "f", "gate", "w", "norm_w", "o", "y", "conv_pool")}
    pointers.update({"A_log": "*fp32", "dt_bias": "*fp32", "pool": "*fp32", "slots": "*i64", "has_state": "*i1",
                     "counters": "*i32", "scale": "fp32", "eps": "fp32", "norm_eps": "fp32"})
    shape = dict(W=4, BW=4, H=32, HV=32, K=128, V=128, BK=128, BV=block_v)
    usage = resources.resource_usage(resources.compile_sm90(kernel, shape, pointers, {"num_warps": 4}))
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage  # the state block stays in registers
