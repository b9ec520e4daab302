"""The fused Gated DeltaNet decode step (conv window, q/k l2norm, gates, recurrence in one kernel)
against its torch reference, the four unfused references in turn: outputs, states and conv windows,
over two steps (the kernel's per-key-head counters must be back at zero after the first). Triton runs
on CUDA, or on the CPU through the interpreter on request."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.gdn_decode import gdn_decode_ref, gdn_decode_triton
from kernel_cases import interpreted, rel_err

HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, WIDTH, SLOTS = 2, 4, 16, 32, 4, 6
CONV_DIM = 2 * HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def step_inputs(tokens: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """mixed_qkv, a, b as the projection's column views (one [tokens, conv_dim + 2 HV + 3] matrix)."""
    proj = torch.randn(tokens, CONV_DIM + 2 * VALUE_HEADS + 3, generator=gen).to(dtype)
    return proj[:, :CONV_DIM], proj[:, CONV_DIM:CONV_DIM + VALUE_HEADS], proj[:, CONV_DIM + VALUE_HEADS:-3]


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_matches_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen).to(dtype)
    A_log, dt_bias = torch.randn(VALUE_HEADS, generator=gen), torch.randn(VALUE_HEADS, generator=gen)
    slots, has_state = torch.tensor([4, 0, 2]), torch.tensor([True, False, True])
    ssm = torch.randn(SLOTS, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    conv = torch.randn(SLOTS, CONV_DIM, WIDTH - 1, generator=gen).to(dtype)
    ssm[0], conv[0] = float("nan"), float("nan")  # a fresh sequence must not read its recycled slot
    pools = [(ssm.clone(), conv.clone()), (ssm.to(device), conv.to(device))]
    shape = dict(heads=HEADS, head_k=KEY_DIM, head_v=VALUE_DIM, scale=KEY_DIM ** -0.5)
    params = [weight, A_log, dt_bias]
    for step in range(2):
        x, a, b = step_inputs(3, dtype, gen)
        expected = gdn_decode_ref(x, a, b, *params, *pools[0], slots, has_state, **shape)
        on = [t.to(device) for t in (x, a, b, *params)]
        out = gdn_decode_triton(*on, *pools[1], slots.to(device), has_state.to(device), **shape)
        assert rel_err(out.cpu(), expected) <= TOLERANCE[dtype], step
        assert rel_err(pools[1][0].cpu(), pools[0][0]) <= TOLERANCE[dtype], step
        assert torch.equal(pools[1][1][slots].cpu(), pools[0][1][slots]), step  # windows: inputs moved, not computed
        has_state = torch.ones(3, dtype=torch.bool)  # the second step continues all three
