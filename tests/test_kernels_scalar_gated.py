"""Scalar-gated rule (Mamba2's SSD): the chunked torch reference against a float64 token recurrence;
the GPU paths (FLA's simple-GLA chunk kernel for prefill, our Triton decode kernel) against it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hypic.kernels.scalar_gated import scalar_decode_triton, scalar_gated_rule, scalar_gated_rule_ref
from kernel_cases import Varlen, check_spans_against_recurrence, interpreted, make_varlen, rel_err

GROUPS, KEY_DIM, VALUE_DIM, SLOTS = 2, 16, 8, 12


def make_inputs(tokens: int, groups: int, heads: int, key_dim: int, value_dim: int,
                gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q = C, k = B [N, G, K]; v = dt x [N, HV, V]; g = dt A [N, HV], slow and fast heads."""
    q, k = (torch.randn(tokens, groups, key_dim, generator=gen) / key_dim ** 0.5 for _ in range(2))
    v = torch.randn(tokens, heads, value_dim, generator=gen)
    g = -F.softplus(torch.randn(tokens, heads, generator=gen)) * torch.logspace(-2, 0, heads)
    return q, k, v, g


def recurrence_f64(q, k, v, g, state, scale):
    """Token by token in float64; value head hv reads group hv // (HV // G)."""
    ratio = v.shape[1] // q.shape[1]
    s = state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        kt, qt = (x[t].double().repeat_interleave(ratio, 0) for x in (k, q))
        s = g[t].double().exp()[:, None, None] * s + kt[:, :, None] * v[t].double()[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, qt * scale))
    return torch.stack(outs), s


def run_ref(x, vl: Varlen, pool, scale):
    return scalar_gated_rule_ref(*x, pool, vl.slots, vl.has_state, vl.cu_seqlens, scale=scale,
                                 num_decodes=vl.num_decodes, seq_lens_cpu=vl.seq_lens)


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("prefill_lens,num_decodes,fresh", [
    ((), 4, ()), ((70, 1, 3, 130), 2, (3, 5)), ((64, 5), 0, (0, 1)), ((200,), 0, ())])
def test_reference_matches_float64_recurrence(ratio: int, prefill_lens: tuple[int, ...], num_decodes: int,
                                              fresh: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(ratio * 100 + len(prefill_lens))
    vl = make_varlen(prefill_lens, num_decodes, SLOTS, gen, fresh=fresh)
    x = make_inputs(vl.num_tokens, GROUPS, GROUPS * ratio, KEY_DIM, VALUE_DIM, gen)
    pool = torch.randn(SLOTS, GROUPS * ratio, KEY_DIM, VALUE_DIM, generator=gen)
    pool[vl.slots[~vl.has_state]] = float("nan")  # a fresh sequence must not read its recycled slot
    before = pool.clone()
    o = run_ref(x, vl, pool, 0.7)
    check_spans_against_recurrence(recurrence_f64, x, vl, before, pool, o, 0.7)


@interpreted
def test_triton_decode_interpreted_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    vl = make_varlen((), 3, SLOTS, gen, fresh=(1,))
    x = make_inputs(3, GROUPS, 3 * GROUPS, KEY_DIM, VALUE_DIM, gen)
    pool = torch.randn(SLOTS, 3 * GROUPS, KEY_DIM, VALUE_DIM, generator=gen)
    expected_pool = pool.clone()
    expected = run_ref(x, vl, expected_pool, 0.3)
    out = torch.empty_like(x[2])
    scalar_decode_triton(*x, pool, vl.slots, vl.has_state, scale=0.3, out=out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- GPU (Nemotron 3 Nano shapes)

GPU_GROUPS, GPU_HEADS, GPU_STATE, GPU_HEAD_DIM, GPU_SLOTS = 8, 64, 128, 64, 80


def gpu_case(prefill_lens: tuple[int, ...], num_decodes: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    fresh = tuple(range(num_decodes, num_decodes + len(prefill_lens), 2))
    vl = make_varlen(prefill_lens, num_decodes, GPU_SLOTS, gen, fresh=fresh)
    q, k, v, g = make_inputs(vl.num_tokens, GPU_GROUPS, GPU_HEADS, GPU_STATE, GPU_HEAD_DIM, gen)
    x = (q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype), g.cuda())
    pool = 0.1 * torch.randn(GPU_SLOTS, GPU_HEADS, GPU_STATE, GPU_HEAD_DIM, generator=gen)
    pool[vl.slots[~vl.has_state]] = float("nan")
    return x, Varlen(vl.seq_lens, vl.num_decodes, vl.slots.cuda(), vl.has_state.cuda()), pool.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefill_lens,num_decodes", [((), 64), ((700, 64, 1, 129), 8), ((2048,), 0)])
def test_gpu_matches_reference(dtype: torch.dtype, prefill_lens: tuple[int, ...], num_decodes: int) -> None:
    x, vl, pool = gpu_case(prefill_lens, num_decodes, dtype, seed=len(prefill_lens))
    expected_pool = pool.clone()
    expected = run_ref(x, vl, expected_pool, 1.0)
    out = scalar_gated_rule(*x, pool, vl.slots, vl.has_state, vl.cu_seqlens.cuda(), scale=1.0,
                            num_decodes=vl.num_decodes, seq_lens_cpu=vl.seq_lens)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4  # float32 prefill takes the reference itself
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, expected) < tol and rel_err(pool, expected_pool) < tol


@pytest.mark.gpu
def test_gpu_decode_replays_in_cuda_graph() -> None:
    x, vl, pool = gpu_case((), 32, torch.bfloat16, seed=7)
    out = torch.empty_like(x[2])

    def step() -> None:
        scalar_decode_triton(*x, pool, vl.slots, vl.has_state, scale=1.0, out=out)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x[2].normal_()
    pool.normal_()
    expected_pool = pool.clone()
    expected = run_ref(x, vl, expected_pool, 1.0)
    graph.replay()
    assert rel_err(out, expected) < 2e-2 and rel_err(pool, expected_pool) < 1e-2
