"""Gated delta rule: the torch reference against a float64 token recurrence; the GPU paths (FLA
chunk kernel for prefill, our Triton decode kernel) against the reference."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.gdn import gated_delta_rule, gated_delta_rule_ref, gdn_decode_triton
from kernel_cases import (GdnInputs, Varlen, check_spans_against_recurrence, gdn_recurrence_f64, interpreted,
                          make_gdn_inputs, make_varlen, rel_err)

HEADS, KEY_DIM, VALUE_DIM, SLOTS = 2, 16, 8, 12


def run_ref(x: GdnInputs, vl: Varlen, pool: torch.Tensor, scale: float) -> torch.Tensor:
    return gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, pool, vl.slots, vl.has_state, vl.cu_seqlens,
                                scale=scale, num_decodes=vl.num_decodes, seq_lens_cpu=vl.seq_lens)


@pytest.mark.parametrize("ratio", [1, 2, 3])
@pytest.mark.parametrize("prefill_lens,num_decodes,fresh", [
    ((), 4, ()),  # decode only
    ((70, 1, 3, 130), 2, (3, 5)),  # mixed; fresh sequences among the prefills
    ((64, 5), 0, (0, 1)),  # prefill only, no initial state (exactly one chunk, and a short one)
    ((200,), 0, ()),  # continuing a state over several chunks
])
def test_reference_matches_float64_recurrence(ratio: int, prefill_lens: tuple[int, ...], num_decodes: int,
                                              fresh: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(ratio * 100 + len(prefill_lens))
    vl = make_varlen(prefill_lens, num_decodes, SLOTS, gen, fresh=fresh)
    x = make_gdn_inputs(vl.num_tokens, HEADS, HEADS * ratio, KEY_DIM, VALUE_DIM, gen)
    pool = torch.randn(SLOTS, HEADS * ratio, KEY_DIM, VALUE_DIM, generator=gen)
    pool[vl.slots[~vl.has_state]] = float("nan")  # a fresh sequence must not read its recycled slot
    before = pool.clone()
    o = run_ref(x, vl, pool, scale=KEY_DIM ** -0.5)
    inputs = (x.q, x.k, x.v, x.g, x.beta)
    check_spans_against_recurrence(gdn_recurrence_f64, inputs, vl, before, pool, o, KEY_DIM ** -0.5)


def test_reference_keeps_value_dtype_and_float32_state() -> None:
    gen = torch.Generator().manual_seed(1)
    vl = make_varlen((9,), 1, SLOTS, gen)
    x = make_gdn_inputs(vl.num_tokens, HEADS, 2 * HEADS, KEY_DIM, VALUE_DIM, gen).to("cpu", torch.bfloat16)
    pool = torch.randn(SLOTS, 2 * HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    o = run_ref(x, vl, pool, scale=0.25)
    assert o.dtype == torch.bfloat16 and o.shape == x.v.shape and pool.dtype == torch.float32


@interpreted
@pytest.mark.parametrize("ratio", [1, 3])
def test_triton_decode_interpreted_matches_reference(ratio: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(ratio)
    vl = make_varlen((), 3, SLOTS, gen, fresh=(1,))
    x = make_gdn_inputs(3, HEADS, HEADS * ratio, KEY_DIM, VALUE_DIM, gen)
    pool = torch.randn(SLOTS, HEADS * ratio, KEY_DIM, VALUE_DIM, generator=gen)
    expected_pool = pool.clone()
    expected = run_ref(x, vl, expected_pool, scale=0.3)
    out = torch.empty_like(x.v)
    gdn_decode_triton(x.q, x.k, x.v, x.g, x.beta, pool, vl.slots, vl.has_state, scale=0.3, out=out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- GPU (Qwen3.5-35B-A3B shapes)

GPU_HEADS, GPU_VALUE_HEADS, GPU_DIM, GPU_SLOTS = 16, 32, 128, 80  # slots: more than the largest batch


def gpu_case(prefill_lens: tuple[int, ...], num_decodes: int, dtype: torch.dtype, seed: int
             ) -> tuple[GdnInputs, Varlen, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    fresh = tuple(range(num_decodes, num_decodes + len(prefill_lens), 2))
    vl = make_varlen(prefill_lens, num_decodes, GPU_SLOTS, gen, fresh=fresh)
    x = make_gdn_inputs(vl.num_tokens, GPU_HEADS, GPU_VALUE_HEADS, GPU_DIM, GPU_DIM, gen).to("cuda", dtype)
    pool = 0.1 * torch.randn(GPU_SLOTS, GPU_VALUE_HEADS, GPU_DIM, GPU_DIM, generator=gen)
    pool[vl.slots[~vl.has_state]] = float("nan")  # recycled slots of fresh sequences must not be read
    pool = pool.cuda()
    cuda_vl = Varlen(vl.seq_lens, vl.num_decodes, vl.slots.cuda(), vl.has_state.cuda())
    return x, cuda_vl, pool


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefill_lens,num_decodes", [((), 64), ((700, 64, 1, 129), 8), ((2048,), 0)])
def test_gpu_matches_reference(dtype: torch.dtype, prefill_lens: tuple[int, ...], num_decodes: int) -> None:
    x, vl, pool = gpu_case(prefill_lens, num_decodes, dtype, seed=len(prefill_lens))
    expected_pool = pool.clone()
    expected = run_ref(x, vl, expected_pool, scale=GPU_DIM ** -0.5)
    out = gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, pool, vl.slots, vl.has_state, vl.cu_seqlens.cuda(),
                           scale=GPU_DIM ** -0.5, num_decodes=vl.num_decodes, seq_lens_cpu=vl.seq_lens)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2  # FLA keeps bf16 intermediates; fp32 dots run as tf32
    assert out.dtype == dtype
    assert rel_err(out, expected) < tol
    assert rel_err(pool, expected_pool) < tol
    assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_gpu_decode_replays_in_cuda_graph() -> None:
    """The decode kernel needs no host sync: capture once, replay on new inputs and states."""
    x, vl, pool = gpu_case((), 32, torch.bfloat16, seed=7)
    out = torch.empty_like(x.v)
    scale = GPU_DIM ** -0.5

    def step() -> None:
        gdn_decode_triton(x.q, x.k, x.v, x.g, x.beta, pool, vl.slots, vl.has_state, scale=scale, out=out)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.v.normal_()
    pool.normal_()
    expected_pool = pool.clone()
    expected = run_ref(x, vl, expected_pool, scale=scale)
    graph.replay()
    assert rel_err(out, expected) < 2e-2 and rel_err(pool, expected_pool) < 1e-2
