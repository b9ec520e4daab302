"""Rotate-and-scatter of cached interior K (pre-RoPE) and V into paged KV (DESIGN §2, §3.5).

Oracle: the model's own RotaryEmbedding applied at the global positions, written by hand."""
from __future__ import annotations

import os

import pytest
import torch

from hypic.kernels.scatter_kv import apply_rope, rope_inv_freq, scatter_kv, scatter_kv_ref, scatter_kv_triton
from hypic.models.layers import RotaryEmbedding

HEADS, HEAD_DIM, ROTARY_DIM, THETA = 2, 16, 4, 10000.0  # partial rotary: a quarter of each head
BLOCKS, BLOCK_SIZE = 6, 4


def make_case(dtype: torch.dtype, gen: torch.Generator, tokens: int = 9, heads: int = HEADS,
              head_dim: int = HEAD_DIM) -> dict:
    """kv_src holds tokens interleaved as [K, V] blocks behind some padding, in shuffled order."""
    row = heads * head_dim
    k = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(tokens, generator=gen)
    kv_src = torch.zeros(7 + 2 * row * tokens, dtype=dtype)
    src_off = 7 + 2 * row * order
    for m in range(tokens):
        kv_src[src_off[m]: src_off[m] + row] = k[m].flatten()
        kv_src[src_off[m] + row: src_off[m] + 2 * row] = v[m].flatten()
    positions = torch.randint(0, 40000, (tokens,), generator=gen)
    dst_slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    return dict(k=k, v=v, kv_src=kv_src, src_off=src_off, positions=positions, dst_slots=dst_slots)


def scatter_with(fn, case: dict, dtype: torch.dtype, device: str = "cpu", rotary_dim: int = ROTARY_DIM
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    heads, head_dim = case["k"].shape[1:]
    k_cache = torch.zeros(BLOCKS, BLOCK_SIZE, heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    fn(case["kv_src"].to(device), case["src_off"].to(device), case["positions"].to(device), k_cache, v_cache,
       case["dst_slots"].to(device), rope_inv_freq(rotary_dim, THETA).to(device))
    return k_cache.cpu(), v_cache.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_matches_model_rotary_at_global_positions(dtype: torch.dtype) -> None:
    case = make_case(dtype, torch.Generator().manual_seed(0))
    k_cache, v_cache = scatter_with(scatter_kv, case, dtype)
    expected_k = RotaryEmbedding(ROTARY_DIM, THETA)(case["k"], case["positions"])
    flat_k, flat_v = k_cache.view(-1, HEADS, HEAD_DIM), v_cache.view(-1, HEADS, HEAD_DIM)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(flat_k[case["dst_slots"]].float(), expected_k.float(), atol=tol, rtol=tol)
    assert torch.equal(flat_v[case["dst_slots"]], case["v"])
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[case["dst_slots"]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_rope_rotations_compose() -> None:
    """R(a) R(b) = R(a + b), the identity that lets 0-based cached K move anywhere."""
    inv_freq = rope_inv_freq(ROTARY_DIM, THETA).double()
    x = torch.randn(5, HEADS, HEAD_DIM, dtype=torch.float64)
    a, b = torch.randint(0, 5000, (5, 1)), torch.randint(0, 5000, (5, 1))
    twice = apply_rope(apply_rope(x, a, inv_freq), b, inv_freq)
    assert torch.allclose(twice, apply_rope(x, a + b, inv_freq), atol=1e-9)
    assert torch.equal(twice[..., ROTARY_DIM:], x[..., ROTARY_DIM:])


@pytest.mark.skipif(os.environ.get("HYPIC_TRITON_INTERPRET") != "1", reason="set HYPIC_TRITON_INTERPRET=1")
def test_triton_scatter_interpreted_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case(torch.float32, torch.Generator().manual_seed(1))
    k_ref, v_ref = scatter_with(scatter_kv_ref, case, torch.float32)
    k_tri, v_tri = scatter_with(scatter_kv_triton, case, torch.float32)
    assert torch.allclose(k_tri, k_ref, atol=1e-5) and torch.equal(v_tri, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_scatter_on_gpu_matches_reference(dtype: torch.dtype) -> None:
    """Qwen3-Next full-attention shapes: 2 kv heads of 256 dims, a quarter rotated."""
    case = make_case(dtype, torch.Generator().manual_seed(2), tokens=20, heads=2, head_dim=256)
    k_ref, v_ref = scatter_with(scatter_kv_ref, case, dtype, "cuda", rotary_dim=64)
    k_tri, v_tri = scatter_with(scatter_kv, case, dtype, "cuda", rotary_dim=64)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(k_tri.float(), k_ref.float(), atol=tol, rtol=tol) and torch.equal(v_tri, v_ref)
