"""Fused MoE: the reference against a dense per-token float64 computation; the grouped-GEMM paths
(torch._grouped_mm, our Triton kernels over expert-padded blocks) against the reference."""
from __future__ import annotations

import functools

import pytest
import torch

from hypic.kernels import moe
from hypic.kernels.moe import (Routing, SharedExpert, expert_blocks, fused_moe, fused_moe_ref, moe_grouped_mm,
                               moe_triton, route, route_blocks_triton, route_topk_ref, routed_moe)
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


def test_reference_padding_rows_come_out_zero() -> None:
    """Rows from valid_tokens on (a captured step's padding) go to no expert; shared output included."""
    x, w_gate_up, w_down, weights, ids = make_case(13, 6, 3, hidden=32, inter=16, seed=7)
    shared = (torch.randn(13, 32), torch.randn(13, 1))
    out = fused_moe_ref(x, w_gate_up, w_down, weights, ids, shared=shared, valid_tokens=torch.tensor([9]))
    real = moe_dense_f64(x[:9], w_gate_up, w_down, weights[:9], ids[:9])
    real = real + torch.sigmoid(shared[1][:9].double()) * shared[0][:9].double()
    torch.testing.assert_close(out[:9].double(), real, rtol=1e-5, atol=1e-5)
    assert not out[9:].any()


def test_reference_keeps_dtype() -> None:
    case = make_case(5, 4, 2, hidden=32, inter=16, seed=0, dtype=torch.bfloat16)
    out = fused_moe(*case)
    assert out.dtype == torch.bfloat16 and rel_err(out, moe_dense_f64(*case)) < 1e-2


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("valid", [None, 0, 15])
def test_expert_blocks_cover_every_pair_once_within_its_expert(block: int, valid: int | None) -> None:
    """Every pair of a real token once (tokens from `valid` on are padding and in no block)."""
    *_, ids = make_case(23, 7, 3, hidden=8, inter=8, seed=block)
    blocks = expert_blocks(ids, 7, block, None if valid is None else torch.tensor([valid], dtype=torch.int32))
    pairs = ids.numel()
    rows = blocks.rows.view(-1, block)
    real = rows < pairs
    assert blocks.num_blocks == pairs // block + 7  # the bound fixed by shapes alone, padding or not
    assert sorted(rows[real].tolist()) == list(range(pairs if valid is None else 3 * valid))
    for j in range(blocks.num_blocks):
        expert = int(blocks.block_expert[j])
        assert expert <= 7 and (expert < 7 or not real[j].any())
        assert (ids.flatten()[rows[j][real[j]]] == expert).all()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
@pytest.mark.parametrize("valid", [None, 11])
def test_grouped_mm_path_matches_reference_on_cpu(valid: int | None) -> None:
    """The sort / offsets / un-permute logic of the CUTLASS path (torch runs _grouped_mm on CPU too);
    padding rows' pairs sort past the last expert's group."""
    case = make_case(17, 8, 3, hidden=32, inter=16, seed=2)
    valid_tokens = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    try:
        out = moe_grouped_mm(*case, valid_tokens=valid_tokens)
    except RuntimeError as exc:  # older CPU builds lack the op's CPU kernel
        pytest.skip(f"torch._grouped_mm on CPU: {exc}")
    torch.testing.assert_close(out, fused_moe_ref(*case, valid_tokens=valid_tokens), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("tokens,valid", [(3, None), (40, None), (40, 26)])
def test_triton_interpreted_matches_reference(tokens: int, valid: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case(tokens, 6, 3, hidden=48, inter=24, seed=tokens)
    valid_tokens = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    torch.testing.assert_close(moe_triton(*case, valid_tokens=valid_tokens),
                               fused_moe_ref(*case, valid_tokens=valid_tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pairs,dtype,rows", [
    (6, torch.bfloat16, 16),  # a decode: 16-row blocks
    (1536, torch.bfloat16, 16),  # Nemotron 3 Nano (128 experts), 256 tokens: 12 pairs an expert
    (2304, torch.bfloat16, 32),  # 384 tokens: 18 an expert, one block of 32 rather than two of 16
    (4096, torch.bfloat16, 64),
    (4096, torch.float32, 16),  # float32's wider tiles spill
])
def test_block_rows_cover_an_average_expert(pairs: int, dtype: torch.dtype, rows: int) -> None:
    assert moe._block_rows(pairs, 128, dtype) == rows


@interpreted
def test_triton_interpreted_blocks_of_32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels in 32-row blocks (bf16 batches of 16 to 32 pairs an expert take them; the
    interpreter runs float32 only, whose rule keeps 16), padding rows included."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moe, "_block_rows", lambda pairs, experts, dtype: 32)
    case = make_case(40, 6, 3, hidden=48, inter=24, seed=5)
    valid_tokens = torch.tensor([31], dtype=torch.int32)
    torch.testing.assert_close(moe_triton(*case, valid_tokens=valid_tokens),
                               fused_moe_ref(*case, valid_tokens=valid_tokens), rtol=1e-5, atol=1e-5)


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
@pytest.mark.parametrize("tokens", [1, 37, 400, 2048])
def test_gpu_relu2_matches_reference(path, tokens: int) -> None:
    """Nemotron 3 Nano's experts: 128 of width 1856 over hidden 2688, top-6, bf16."""
    case = make_case(tokens, 128, 6, 2688, 1856, seed=tokens, dtype=torch.bfloat16, device="cuda",
                     activation="relu2")
    out = path(*case, activation="relu2")
    assert out.dtype == torch.bfloat16 and rel_err(out, fused_moe_ref(*case, activation="relu2")) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", [fused_moe, moe_triton])
@pytest.mark.parametrize("tokens,valid", [(48, 37), (512, 384), (1024, 700)])
def test_gpu_padding_rows_come_out_zero(path, tokens: int, valid: int) -> None:
    """A captured step's padding rows (Nemotron 3 Nano's experts): real rows as the reference, padding
    rows zero; 512 x 6 pairs run in 32-row blocks, 1024 x 6 take the CUTLASS path through fused_moe."""
    case = make_case(tokens, 128, 6, 2688, 1856, seed=valid, dtype=torch.bfloat16, device="cuda",
                     activation="relu2")
    valid_tokens = torch.tensor([valid], dtype=torch.int32, device="cuda")
    out = path(*case, activation="relu2", valid_tokens=valid_tokens)
    expected = fused_moe_ref(*case, activation="relu2", valid_tokens=valid_tokens)
    assert rel_err(out[:valid], expected[:valid]) < 2e-2 and not out[valid:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("path", [fused_moe, moe_triton])
def test_gpu_padding_count_is_read_at_replay(path) -> None:
    """The count of real rows is device data: a replay with another count skips other rows."""
    x, w_gate_up, w_down, weights, ids = make_case(96, 128, 6, 2688, 1856, seed=3, dtype=torch.bfloat16,
                                                   device="cuda", activation="relu2")
    valid_tokens = torch.tensor([90], dtype=torch.int32, device="cuda")
    run = functools.partial(path, x, w_gate_up, w_down, weights, ids, activation="relu2", valid_tokens=valid_tokens)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    valid_tokens.fill_(41)
    ids.copy_(torch.randn(96, 128, device="cuda").topk(6).indices)
    graph.replay()
    expected = fused_moe_ref(x, w_gate_up, w_down, weights, ids, activation="relu2", valid_tokens=valid_tokens)
    assert rel_err(out[:41], expected[:41]) < 2e-2 and not out[41:].any()


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



def make_shared(x: torch.Tensor, inter: int, seed: int) -> SharedExpert:
    """A SwiGLU shared expert on x's device and dtype, its gate logits for x's rows."""
    gen = torch.Generator(x.device.type).manual_seed(seed)
    hidden = x.shape[1]
    gate_up = torch.randn(2 * inter, hidden, generator=gen, device=x.device) / hidden ** 0.5
    down = torch.randn(hidden, inter, generator=gen, device=x.device) / inter ** 0.5
    logit = torch.randn(x.shape[0], 1, generator=gen, device=x.device)
    return SharedExpert(*(t.to(x.dtype) for t in (gate_up, down, logit)))


@interpreted
@pytest.mark.parametrize("tokens,valid", [(3, None), (40, 26)])
def test_triton_interpreted_shared_expert_as_blocks_matches_reference(tokens: int, valid: int | None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared expert run by the expert kernels' extra blocks (its rows after the pairs'), over the
    router's layout, against the reference plus torch's shared MLP; padding rows zero."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w_gate_up, w_down, *_ = make_case(tokens, 6, 3, hidden=48, inter=24, seed=tokens)
    shared = make_shared(x, 24, seed=tokens + 1)
    logits = torch.randn(tokens, 6, generator=torch.Generator().manual_seed(tokens + 2))
    valid_tokens = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    weights, ids, blocks = route_blocks_triton(logits, Routing(3, True), 16, valid_tokens)
    out = moe_triton(x, w_gate_up, w_down, weights, ids, blocks=blocks, shared_expert=shared,
                     valid_tokens=valid_tokens)
    expected = fused_moe_ref(x, w_gate_up, w_down, *route_topk_ref(logits, 3, True), shared=shared.computed(x),
                             valid_tokens=valid_tokens)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_shared_expert_fuses_only_at_the_routed_experts_size() -> None:
    x, _, w_down, *_ = make_case(2, 4, 2, hidden=32, inter=16, seed=0)
    assert make_shared(x, 16, seed=1).fuses_with(w_down)
    assert not make_shared(x, 8, seed=1).fuses_with(w_down)


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [GPU_INTER, GPU_INTER // 2])  # fused into the expert kernels; not (its own GEMMs)
@pytest.mark.parametrize("tokens,valid", [(1, None), (16, 11), (17, None)])  # 17 x 8 pairs: past the decode path
def test_gpu_routed_decode_with_shared_expert_matches_reference_and_replays(inter: int, tokens: int,
                                                                            valid: int | None) -> None:
    x, w_gate_up, w_down, *_ = make_case(tokens, GPU_EXPERTS, GPU_TOPK, GPU_HIDDEN, GPU_INTER, seed=tokens,
                                         dtype=torch.bfloat16, device="cuda")
    shared = make_shared(x, inter, seed=tokens + 1)
    logits = torch.randn(tokens, GPU_EXPERTS, device="cuda")
    routing = Routing(GPU_TOPK, True)
    valid_tokens = None if valid is None else torch.tensor([valid], dtype=torch.int32, device="cuda")

    def expected() -> torch.Tensor:
        return fused_moe_ref(x, w_gate_up, w_down, *route(logits, routing), shared=shared.computed(x),
                             valid_tokens=valid_tokens)
    out = routed_moe(x, logits, routing, w_gate_up, w_down, shared_expert=shared, valid_tokens=valid_tokens)
    assert rel_err(out, expected()) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_moe(x, logits, routing, w_gate_up, w_down, shared_expert=shared, valid_tokens=valid_tokens)
    logits.normal_()
    x.normal_()
    shared.gate_logit.normal_()
    graph.replay()
    assert rel_err(out, expected()) < 2e-2
    if valid is not None:
        assert not out[valid:].any()


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
