"""The fused Gated DeltaNet decode step (conv window, q/k l2norm, gates, recurrence, gated norm in one
kernel) against its torch reference, the five unfused references in turn: outputs, states and conv
windows, over two steps (the kernel's counters must be back at zero after the first). Triton runs
on CUDA, or on the CPU through the interpreter on request."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.gdn_decode import GdnDecodeLayer, gdn_decode_ref, gdn_decode_triton
from kernel_cases import interpreted, rel_err

HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, WIDTH, SLOTS = 2, 4, 16, 32, 4, 6
CONV_DIM = 2 * HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def step_inputs(tokens: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """mixed_qkv, z, a, b as the projection's column views (one [tokens, conv_dim + HV V + 2 HV + 3] matrix)."""
    z_end = CONV_DIM + VALUE_HEADS * VALUE_DIM
    proj = torch.randn(tokens, z_end + 2 * VALUE_HEADS + 3, generator=gen).to(dtype)
    z = proj[:, CONV_DIM:z_end].unflatten(1, (VALUE_HEADS, VALUE_DIM))
    return proj[:, :CONV_DIM], z, proj[:, z_end:z_end + VALUE_HEADS], proj[:, z_end + VALUE_HEADS:-3]


def layer_on(device: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[GdnDecodeLayer, GdnDecodeLayer]:
    """A layer's decode weights on the CPU and on `device`."""
    weights = [torch.randn(CONV_DIM, WIDTH, generator=gen).to(dtype), torch.randn(VALUE_HEADS, generator=gen),
               torch.randn(VALUE_HEADS, generator=gen), (1 + 0.1 * torch.randn(VALUE_DIM, generator=gen)).to(dtype)]
    shape = (1e-6, HEADS, KEY_DIM, VALUE_DIM, KEY_DIM ** -0.5)
    return GdnDecodeLayer(*weights, *shape), GdnDecodeLayer(*(w.to(device) for w in weights), *shape)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_matches_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    layers = layer_on(device, dtype, gen)
    slots, has_state = torch.tensor([4, 0, 2]), torch.tensor([True, False, True])
    ssm = torch.randn(SLOTS, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    conv = torch.randn(SLOTS, CONV_DIM, WIDTH - 1, generator=gen).to(dtype)
    ssm[0], conv[0] = float("nan"), float("nan")  # a fresh sequence must not read its recycled slot
    pools = [(ssm.clone(), conv.clone()), (ssm.to(device), conv.to(device))]
    for step in range(2):
        inputs = step_inputs(3, dtype, gen)
        expected = gdn_decode_ref(*inputs, layers[0], *pools[0], slots, has_state)
        on = [t.to(device) for t in inputs]
        out = gdn_decode_triton(*on, layers[1], *pools[1], slots.to(device), has_state.to(device))
        assert rel_err(out.cpu(), expected) <= TOLERANCE[dtype], step
        assert rel_err(pools[1][0].cpu(), pools[0][0]) <= TOLERANCE[dtype], step
        assert torch.equal(pools[1][1][slots].cpu(), pools[0][1][slots]), step  # windows: inputs moved, not computed
        has_state = torch.ones(3, dtype=torch.bool)  # the second step continues all three
