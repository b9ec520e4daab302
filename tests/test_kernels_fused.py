"""The fused per-token kernels (norms, RoPE, GDN inputs, SwiGLU activation, MoE routing / layout /
combine, split-KV merge) against their torch references, on random inputs with strided views where
the model passes them. Triton runs on CUDA, or on the CPU through the interpreter on request."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.activation import silu_and_mul, silu_and_mul_triton, sigmoid_gate, sigmoid_gate_triton
from hypic.kernels.gdn_inputs import gdn_gates_ref, gdn_gates_triton, qk_l2norm, qk_l2norm_triton
from hypic.kernels.moe import (Routing, expert_blocks_ref, expert_blocks_triton, moe_combine, moe_combine_triton,
                               route_blocks_triton, route_grouped_sigmoid, route_topk_ref, route_topk_triton)
from hypic.kernels.norms import gated_rms_norm_ref, norm_triton, rms_norm_ref, rms_norm_rope_write, rope_ref
from hypic.kernels.paged_attention import merge_splits, merge_splits_triton
from hypic.kernels.scatter_kv import rope_inv_freq
from kernel_cases import interpreted, rel_err

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def on(device: str, monkeypatch: pytest.MonkeyPatch) -> str:
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return device


DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(0)
    x, res, w = randn(37, 96, gen=gen, dtype=dtype), randn(37, 96, gen=gen, dtype=dtype), randn(96, gen=gen)
    y = norm_triton(x.to(dev), w.to(dev), 1e-6, offset=True)
    assert rel_err(y.cpu(), rms_norm_ref(x, w, 1e-6)) <= TOLERANCE[dtype]
    total = torch.empty_like(x).to(dev)
    y = norm_triton(x.to(dev), w.to(dev), 1e-6, offset=True, residual=res.to(dev), total=total)
    # round-to-nearest on the GPU, as torch's add; the interpreter's bf16 cast may truncate
    assert torch.equal(total.cpu(), x + res) if device == "cuda" else rel_err(total.cpu(), x + res) <= 1e-2
    assert rel_err(y.cpu(), rms_norm_ref(x + res, w, 1e-6)) <= TOLERANCE[dtype]
    both = randn(11, 5, 64, gen=gen, dtype=dtype)  # [N, heads, 2D]: value and gate interleaved per head
    value, gate, gw = both[..., :32], both[..., 32:], randn(32, gen=gen, dtype=dtype)
    y = norm_triton(value.to(dev), gw.to(dev), 1e-6, offset=False, gate=gate.to(dev))
    assert rel_err(y.cpu(), gated_rms_norm_ref(value, gate, gw, 1e-6)) <= 2 * TOLERANCE[dtype]  # 3 roundings


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normed", [True, False])
def test_rope_with_and_without_norm_matches_reference(device: str, normed: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(1)
    both = randn(13, 3, 2 * 48, gen=gen, dtype=torch.bfloat16)
    q, w = both[..., :48], randn(48, gen=gen)  # strided, as the attention's q beside its gate
    positions, inv_freq = torch.randint(0, 5000, (13,), generator=gen), rope_inv_freq(16, 1e6)
    y = norm_triton(q.to(dev), w.to(dev) if normed else None, 1e-6, offset=True, positions=positions.to(dev),
                    inv_freq=inv_freq.to(dev))
    expected = rope_ref(rms_norm_ref(q, w, 1e-6) if normed else q, positions, inv_freq)
    assert rel_err(y.cpu(), expected) <= 1e-2
    if device == "cuda":  # channels past the rotary ones pass (the interpreter's bf16 casts may truncate)
        assert torch.equal(y.cpu()[..., 16:], expected[..., 16:])


@pytest.mark.parametrize("device", DEVICES)
def test_rope_written_into_cache_rows_matches_reference(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """K normed, rotated and written at its rows, V copied to its cache's same rows, in one launch."""
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(7)
    both = randn(5, 2, 3 * 32, gen=gen, dtype=torch.bfloat16)
    k, v, w = both[..., :32], both[..., 64:], randn(32, gen=gen)  # strided, as the projection's k / v columns
    positions, inv_freq = torch.randint(0, 5000, (5,), generator=gen), rope_inv_freq(16, 1e6)
    rows = torch.tensor([9, 2, 30, 17, 4])  # block * block_size + offset, block_size 8
    cache, v_cache = (randn(4, 8, 2, 32, gen=gen, dtype=torch.bfloat16) for _ in range(2))
    expected, v_expected = cache.clone(), v_cache.clone()
    rms_norm_rope_write(k, w, 1e-6, positions, inv_freq, expected, rows, v, v_expected)  # CPU: the torch reference
    written, v_written = cache.clone().to(dev), v_cache.clone().to(dev)
    if device == "cpu":  # the Triton kernel itself, interpreted
        norm_triton(k, w, 1e-6, offset=True, positions=positions, inv_freq=inv_freq, out=written.view(-1, 2, 32),
                    out_rows=rows, copy=(v, v_written.view(-1, 2, 32)))
    else:
        rms_norm_rope_write(k.to(dev), w.to(dev), 1e-6, positions.to(dev), inv_freq.to(dev), written, rows.to(dev),
                            v.to(dev), v_written)
    written, untouched = written.cpu().view(-1, 2, 32), torch.ones(32, dtype=torch.bool)
    v_written = v_written.cpu().view(-1, 2, 32)
    untouched[rows] = False
    assert torch.equal(written[untouched], cache.view(-1, 2, 32)[untouched])
    assert torch.equal(v_written[untouched], v_cache.view(-1, 2, 32)[untouched])
    assert torch.equal(v_written[rows], v) and torch.equal(v_expected.view(-1, 2, 32)[rows], v)
    assert rel_err(written[rows], rope_ref(rms_norm_ref(k, w, 1e-6), positions, inv_freq)) <= 1e-2
    assert rel_err(written, expected.view(-1, 2, 32)) <= 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_matches_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(8)
    x, both = randn(9, 70, gen=gen, dtype=dtype), randn(9, 2 * 70, gen=gen, dtype=dtype)
    gate = both[:, 70:]  # a row-strided view
    assert rel_err(sigmoid_gate_triton(x.to(dev), gate.to(dev)).cpu(), sigmoid_gate(x, gate)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_inputs_match_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(2)
    conv_out = randn(19, 2 * 4 * 32 + 40, gen=gen, dtype=dtype)
    q, k = qk_l2norm_triton(conv_out.to(dev), 4, 32)
    q_ref, k_ref = qk_l2norm(conv_out, 4, 32)
    assert rel_err(q.cpu(), q_ref) <= TOLERANCE[dtype] and rel_err(k.cpu(), k_ref) <= TOLERANCE[dtype]
    proj = randn(19, 50, gen=gen, dtype=dtype) * 8  # b and a are column slices of the projection
    b, a = proj[:, 10:22], proj[:, 30:42]
    A_log, dt_bias = torch.rand(12, generator=gen).add(1).log(), randn(12, gen=gen)
    g, beta = gdn_gates_triton(a.to(dev), b.to(dev), A_log.to(dev), dt_bias.to(dev))
    g_ref, beta_ref = gdn_gates_ref(a, b, A_log, dt_bias)
    assert rel_err(g.cpu(), g_ref) <= 1e-5 and rel_err(beta.cpu(), beta_ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(3)
    h = randn(23, 2 * 40, gen=gen, dtype=dtype)
    assert rel_err(silu_and_mul_triton(h.to(dev)).cpu(), silu_and_mul(h)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_matches_reference(device: str, renormalize: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(4)
    logits = randn(21, 24, gen=gen) * 3  # float32: no ties
    weights, ids = route_topk_triton(logits.to(dev), 5, renormalize)
    weights_ref, ids_ref = route_topk_ref(logits, 5, renormalize)
    assert torch.equal(ids.cpu(), ids_ref) and rel_err(weights.cpu(), weights_ref) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("indexed", [True, False])
def test_moe_combine_matches_reference(device: str, indexed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(5)
    tokens, top_k, hidden = 9, 3, 80
    y = randn(tokens * top_k, hidden, gen=gen, dtype=torch.bfloat16 if indexed else torch.float32)
    weights = torch.rand(tokens, top_k, generator=gen)
    rows = torch.randperm(tokens * top_k, generator=gen) if indexed else None
    shared = (randn(tokens, hidden, gen=gen, dtype=torch.bfloat16), randn(tokens, 1, gen=gen, dtype=torch.bfloat16))
    valid = torch.tensor([6], dtype=torch.int32)  # tokens 6.. are padding: zero, whatever their y rows hold
    for extra, valid_tokens in ((None, None), (shared, None), (shared, valid)):
        moved = None if extra is None else tuple(t.to(dev) for t in extra)
        out = moe_combine_triton(y.to(dev), weights.to(dev), None if rows is None else rows.to(dev),
                                 torch.bfloat16, moved, None if valid_tokens is None else valid_tokens.to(dev))
        expected = moe_combine(y, weights, rows, torch.bfloat16, extra, valid_tokens)
        assert rel_err(out.cpu(), expected) <= 1e-2
        assert valid_tokens is None or not out[6:].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sigmoid", [False, True])  # softmax (Qwen); biased sigmoid, scaled (Nemotron 3, Kimi)
@pytest.mark.parametrize("tokens,block,valid", [(1, 16, None), (3, 4, None), (6, 2, 4)])  # valid: padding from 4 on
def test_route_blocks_match_routing_and_reference_layout(device: str, sigmoid: bool, tokens: int, block: int,
                                                         valid: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(5 + tokens)
    logits = randn(tokens, 24, gen=gen) * 3  # float32: no ties
    logits[:, 7] = logits[:, 7].abs() + 20  # every token picks expert 7: a run longer than a block
    bias = randn(24, gen=gen) if sigmoid else None
    routing = Routing(5, True, None if bias is None else bias.to(dev), scaling=2.5 if sigmoid else 1.0)
    valid_tokens = None if valid is None else torch.tensor([valid])
    weights, ids, blocks = route_blocks_triton(logits.to(dev), routing, block,
                                               None if valid is None else valid_tokens.to(dev))
    if sigmoid:
        weights_ref, ids_ref = route_grouped_sigmoid(logits, bias, 5, 1, 1, True, 2.5)
    else:
        weights_ref, ids_ref = route_topk_ref(logits, 5, True)
    assert torch.equal(ids.cpu(), ids_ref) and rel_err(weights.cpu(), weights_ref) <= 1e-5
    ref = expert_blocks_ref(ids_ref, 24, block, valid_tokens)
    assert blocks.block == block and torch.equal(blocks.block_expert.cpu(), ref.block_expert)
    assert torch.equal(blocks.rows.cpu(), ref.rows)  # pairs in order within each expert: the very layout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,block,valid", [(1, 16, None), (37, 16, None), (300, 64, None), (37, 16, 30),
                                                (300, 64, 0)])
def test_expert_blocks_triton_cover_every_pair_once_within_its_expert(device: str, tokens: int, block: int,
                                                                     valid: int | None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pair of a real token (before `valid`, if given) once, in its expert's blocks."""
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(tokens)
    experts, top_k = 20, 4
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k).indices
    valid_tokens = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    blocks = expert_blocks_triton(ids.to(dev), experts, block, None if valid is None else valid_tokens.to(dev))
    ref = expert_blocks_ref(ids, experts, block, valid_tokens)
    assert torch.equal(blocks.block_expert.cpu(), ref.block_expert)
    rows, pairs = blocks.rows.cpu().view(-1, block), ids.numel()
    real = rows < pairs
    assert torch.equal(real, ref.rows.view(-1, block) < pairs)  # same padding layout; order within may differ
    assert sorted(rows[real].tolist()) == list(range(pairs if valid is None else valid * top_k))
    for j, expert in enumerate(blocks.block_expert.tolist()):
        assert (ids.flatten()[rows[j][real[j]]] == expert).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [False, True])
def test_merge_splits_matches_reference(device: str, gated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, gen = on(device, monkeypatch), torch.Generator().manual_seed(6)
    partial, lse = randn(5, 7, 4, 40, gen=gen), randn(5, 7, 4, gen=gen) * 4
    lse[1:3, 2] = float("-inf")  # empty splits
    gate = randn(7, 2 * 160, gen=gen, dtype=torch.bfloat16)[:, 160:] if gated else None  # row-strided
    out, expected = torch.empty(7, 4, 40, dtype=torch.bfloat16).to(dev), torch.empty(7, 4, 40, dtype=torch.bfloat16)
    merge_splits_triton(partial.to(dev), lse.to(dev), out, gate.to(dev) if gated else None)
    merge_splits(partial, lse, expected, gate)
    assert rel_err(out.cpu(), expected) <= 1e-2
    if gated:  # the gate did apply: the ungated merge is far from it
        ungated = torch.empty_like(expected)
        merge_splits(partial, lse, ungated)
        assert rel_err(ungated, expected) > 0.1
