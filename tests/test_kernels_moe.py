"""Fused MoE: the reference against a dense per-token float64 computation; the grouped-GEMM paths
(torch._grouped_mm, our Triton kernels over expert-padded blocks) against the reference."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.moe import (Routing, expert_blocks, fused_moe, fused_moe_ref, moe_grouped_mm, moe_triton,
                               route, route_blocks_triton, route_topk_ref, routed_moe)
from kernel_cases import interpreted, moe_dense_f64, rel_err


def make_case(tokens: int, experts: int, topk: int, hidden: int, inter: int, seed: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu", activation: str = "silu"
              ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device)
    rows = 2 * inter if activation == "silu" else inter  # relu2 experts: up rows only
    w_gate_up = torch.randn(experts, rows, hidden, generator=gen, device=device) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen, device=device) / inter ** 0.5
    weights, ids = torch.randn(tokens, experts, generator=gen, device=device).softmax(-1).topk(topk)
    return (*(t.to(dtype) for t in (x, w_gate_up, w_down)), weights, ids)


@pytest.mark.parametrize("tokens,experts,topk", [(1, 8, 2), (13, 6, 3), (40, 16, 4)])
def test_reference_matches_dense_per_token(tokens: int, experts: int, topk: int) -> None:
    case = make_case(tokens, experts, topk, hidden=32, inter=16, seed=tokens)
    torch.testing.assert_close(fused_moe_ref(*case).double(), moe_dense_f64(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,experts,topk", [(1, 8, 2), (13, 6, 3)])
def test_relu2_reference_matches_dense_per_token(tokens: int, experts: int, topk: int) -> None:
    case = make_case(tokens, experts, topk, hidden=32, inter=16, seed=tokens, activation="relu2")
    expected = moe_dense_f64(*case, activation="relu2")
    torch.testing.assert_close(fused_moe_ref(*case, activation="relu2").double(), expected, rtol=1e-5, atol=1e-5)


def test_reference_keeps_dtype() -> None:
    case = make_case(5, 4, 2, hidden=32, inter=16, seed=0, dtype=torch.bfloat16)
    out = fused_moe(*case)
    assert out.dtype == torch.bfloat16 and rel_err(out, moe_dense_f64(*case)) < 1e-2


@pytest.mark.parametrize("block", [4, 16])
def test_expert_blocks_cover_every_pair_once_within_its_expert(block: int) -> None:
    *_, ids = make_case(23, 7, 3, hidden=8, inter=8, seed=block)
    blocks = expert_blocks(ids, 7, block)
    pairs = ids.numel()
    rows = blocks.rows.view(-1, block)
    real = rows < pairs
    assert sorted(rows[real].tolist()) == list(range(pairs))
    for j in range(blocks.num_blocks):
        expert = int(blocks.block_expert[j])
        assert expert <= 7 and (expert < 7 or not real[j].any())
        assert (ids.flatten()[rows[j][real[j]]] == expert).all()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
def test_grouped_mm_path_matches_reference_on_cpu() -> None:
    """The sort / offsets / un-permute logic of the CUTLASS path (torch runs _grouped_mm on CPU too)."""
    case = make_case(17, 8, 3, hidden=32, inter=16, seed=2)
    try:
        out = moe_grouped_mm(*case)
    except RuntimeError as exc:  # older CPU builds lack the op's CPU kernel
        pytest.skip(f"torch._grouped_mm on CPU: {exc}")
    torch.testing.assert_close(out, fused_moe_ref(*case), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("tokens", [3, 40])
def test_triton_interpreted_matches_reference(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case(tokens, 6, 3, hidden=48, inter=24, seed=tokens)
    torch.testing.assert_close(moe_triton(*case), fused_moe_ref(*case), rtol=1e-5, atol=1e-5)


@interpreted
def test_relu2_triton_interpreted_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case(9, 6, 3, hidden=48, inter=24, seed=4, activation="relu2")
    torch.testing.assert_close(moe_triton(*case, activation="relu2"), fused_moe_ref(*case, activation="relu2"),
                               rtol=1e-5, atol=1e-5)


@interpreted
def test_triton_interpreted_over_the_routers_blocks_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w_gate_up, w_down, *_ = make_case(3, 6, 3, hidden=48, inter=24, seed=5)
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(6))
    weights, ids, blocks = route_blocks_triton(logits, Routing(3, True), 16)
    out = moe_triton(x, w_gate_up, w_down, weights, ids, blocks=blocks)
    expected = fused_moe_ref(x, w_gate_up, w_down, *route_topk_ref(logits, 3, True))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("path", [fused_moe, moe_triton])
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_gpu_relu2_matches_reference(path, tokens: int) -> None:
    """Nemotron 3 Nano's experts: 128 of width 1856 over hidden 2688, top-6, bf16."""
    case = make_case(tokens, 128, 6, 2688, 1856, seed=tokens, dtype=torch.bfloat16, device="cuda",
                     activation="relu2")
    out = path(*case, activation="relu2")
    assert out.dtype == torch.bfloat16 and rel_err(out, fused_moe_ref(*case, activation="relu2")) < 2e-2


# ----------------------------------------------------------------------------- GPU (Qwen3.5-35B-A3B MoE)

GPU_EXPERTS, GPU_TOPK, GPU_HIDDEN, GPU_INTER = 256, 8, 2048, 512


@pytest.mark.gpu
@pytest.mark.parametrize("path", [fused_moe, moe_triton])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_gpu_matches_reference(path, dtype: torch.dtype, tokens: int) -> None:
    case = make_case(tokens, GPU_EXPERTS, GPU_TOPK, GPU_HIDDEN, GPU_INTER, seed=tokens, dtype=dtype, device="cuda")
    out = path(*case)
    assert out.dtype == dtype
    assert rel_err(out, fused_moe_ref(*case)) < (2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("path", [fused_moe, moe_triton])
def test_gpu_decode_replays_in_cuda_graph(path) -> None:
    x, w_gate_up, w_down, weights, ids = make_case(64, GPU_EXPERTS, GPU_TOPK, GPU_HIDDEN, GPU_INTER, seed=1,
                                                   dtype=torch.bfloat16, device="cuda")
    out = path(x, w_gate_up, w_down, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = path(x, w_gate_up, w_down, weights, ids)
    x.normal_()
    new_weights, new_ids = torch.randn(64, GPU_EXPERTS, device="cuda").softmax(-1).topk(GPU_TOPK)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    assert rel_err(out, fused_moe_ref(x, w_gate_up, w_down, weights, ids)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("sigmoid", [False, True])  # Qwen's softmax router; Nemotron 3 / Kimi's biased sigmoid
@pytest.mark.parametrize("tokens", [1, 16, 17])  # 16 x 8 pairs: the routed decode path's largest; 17: past it
def test_gpu_routed_decode_matches_reference_and_replays(sigmoid: bool, tokens: int) -> None:
    x, w_gate_up, w_down, *_ = make_case(tokens, GPU_EXPERTS, GPU_TOPK, GPU_HIDDEN, GPU_INTER, seed=tokens,
                                         dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(tokens, GPU_EXPERTS, device="cuda")
    routing = Routing(GPU_TOPK, True, torch.randn(GPU_EXPERTS, device="cuda") if sigmoid else None,
                      scaling=2.5 if sigmoid else 1.0)
    out = routed_moe(x, logits, routing, w_gate_up, w_down)
    assert rel_err(out, fused_moe_ref(x, w_gate_up, w_down, *route(logits, routing))) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_moe(x, logits, routing, w_gate_up, w_down)
    logits.normal_()
    x.normal_()
    graph.replay()
    assert rel_err(out, fused_moe_ref(x, w_gate_up, w_down, *route(logits, routing))) < 2e-2
