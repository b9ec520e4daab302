"""Causal conv1d with per-slot windows: the reference against a token-by-token loop; the Triton
kernels (decode and varlen) against the reference."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.conv1d import causal_conv1d, causal_conv1d_ref, conv1d_decode_triton, conv1d_varlen_triton
from kernel_cases import Varlen, conv_loop_f64, interpreted, make_varlen

DIM, WIDTH, SLOTS = 12, 4, 10


def make_case(prefill_lens: tuple[int, ...], num_decodes: int, fresh: tuple[int, ...], seed: int,
              dim: int = DIM, dtype: torch.dtype = torch.float32, slots: int = SLOTS
              ) -> tuple[Varlen, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vl = make_varlen(prefill_lens, num_decodes, slots, gen, fresh=fresh)
    x = torch.randn(vl.num_tokens, dim, generator=gen).to(dtype)
    weight = torch.randn(dim, WIDTH, generator=gen).to(dtype)
    bias = torch.randn(dim, generator=gen).to(dtype)
    pool = torch.randn(slots, dim, WIDTH - 1, generator=gen).to(dtype)
    return vl, x, weight, bias, pool


def run_ref(vl: Varlen, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pool: torch.Tensor,
            activation: str | None = "silu") -> torch.Tensor:
    return causal_conv1d_ref(x, weight, bias, pool, vl.slots, vl.has_state, vl.cu_seqlens,
                             num_decodes=vl.num_decodes, seq_lens_cpu=vl.seq_lens, activation=activation)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("prefill_lens,num_decodes,fresh", [
    ((), 3, ()),  # decode only
    ((1, 2, 9, 5), 2, (3, 5)),  # shorter than W-1 continuing from a window; fresh sequences
    ((40,), 0, (0,)),
])
def test_reference_matches_token_loop(activation: str | None, with_bias: bool, prefill_lens: tuple[int, ...],
                                      num_decodes: int, fresh: tuple[int, ...]) -> None:
    vl, x, weight, bias, pool = make_case(prefill_lens, num_decodes, fresh, seed=len(prefill_lens))
    bias = bias if with_bias else None
    pool[vl.slots[~vl.has_state]] = float("nan")  # a fresh sequence must not read its recycled slot
    before = pool.clone()
    y = run_ref(vl, x, weight, bias, pool, activation)
    starts = vl.starts
    for b, slot in enumerate(vl.slots.tolist()):
        window = before[slot] if vl.has_state[b] else torch.zeros(DIM, WIDTH - 1)
        ref_y, ref_window = conv_loop_f64(x[starts[b]:starts[b + 1]], weight, bias, window, activation)
        torch.testing.assert_close(y[starts[b]:starts[b + 1]].double(), ref_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot].double(), ref_window, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[vl.slots] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_unknown_activation_is_rejected() -> None:
    vl, x, weight, bias, pool = make_case((3,), 0, (), seed=0)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, bias, pool, vl.slots, vl.has_state, vl.cu_seqlens, num_decodes=0,
                      seq_lens_cpu=vl.seq_lens, activation="gelu")


def run_triton(vl: Varlen, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               pool: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Both Triton paths, split as the dispatcher splits them (decodes first)."""
    y = torch.empty_like(x)
    nd = vl.num_decodes
    if nd:
        conv1d_decode_triton(x[:nd], weight, bias, pool, vl.slots[:nd], vl.has_state[:nd], "silu", out=y[:nd])
    if len(vl.seq_lens) > nd:
        conv1d_varlen_triton(x, weight, bias, pool, vl.slots, vl.has_state, cu_seqlens, "silu", out=y,
                             first_seq=nd, seq_lens=vl.seq_lens[nd:])
    return y


@interpreted
def test_triton_interpreted_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    vl, x, weight, bias, pool = make_case((1, 2, 70), 3, (4,), seed=3)
    expected_pool = pool.clone()
    expected = run_ref(vl, x, weight, bias, expected_pool)
    y = run_triton(vl, x, weight, bias, pool, vl.cu_seqlens)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_pool)


# ----------------------------------------------------------------------------- GPU (Qwen3.5-35B-A3B: conv over q, k, v)

GPU_DIM = 2 * 16 * 128 + 32 * 128
GPU_SLOTS = 160  # more than the largest batch: every sequence has its own slot


def to_cuda(vl: Varlen, *tensors: torch.Tensor) -> tuple:
    return (Varlen(vl.seq_lens, vl.num_decodes, vl.slots.cuda(), vl.has_state.cuda()),
            *(t.cuda() for t in tensors))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefill_lens,num_decodes", [((), 128), ((1000, 2, 77, 1), 16), ((4096,), 0)])
def test_gpu_matches_reference(dtype: torch.dtype, prefill_lens: tuple[int, ...], num_decodes: int) -> None:
    fresh = tuple(range(num_decodes, num_decodes + len(prefill_lens), 2))
    case = make_case(prefill_lens, num_decodes, fresh, seed=len(prefill_lens), dim=GPU_DIM, dtype=dtype,
                     slots=GPU_SLOTS)
    vl, x, weight, bias, pool = to_cuda(*case)
    expected_pool = pool.clone()
    expected = run_ref(vl, x, weight, None, expected_pool)
    y = causal_conv1d(x, weight, None, pool, vl.slots, vl.has_state, vl.cu_seqlens.cuda(),
                      num_decodes=num_decodes, seq_lens_cpu=vl.seq_lens, activation="silu")
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, expected, **tol)
    torch.testing.assert_close(pool, expected_pool)  # windows are copies of inputs: exact


@pytest.mark.gpu
def test_gpu_decode_replays_in_cuda_graph() -> None:
    vl, x, weight, bias, pool = to_cuda(*make_case((), 64, (), seed=5, dim=GPU_DIM, dtype=torch.bfloat16,
                                                    slots=GPU_SLOTS))
    y = torch.empty_like(x)

    def step() -> None:
        conv1d_decode_triton(x, weight, bias, pool, vl.slots, vl.has_state, "silu", out=y)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.normal_()
    expected_pool = pool.clone()
    expected = run_ref(vl, x, weight, bias, expected_pool)
    graph.replay()
    torch.testing.assert_close(y, expected, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(pool, expected_pool)
