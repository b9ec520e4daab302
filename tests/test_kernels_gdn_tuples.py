"""Gated DeltaNet tuples as ordered products of chunk factors (`gdn_span_tuples`) against the float64
token recurrence, the [v | 0] chunk-kernel capture they replace, and (Triton) the torch reference."""
from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import interpreted, rel_err

from hypic.kernels.gdn_tuples import gdn_span_tuples_ref, gdn_span_tuples_triton
from hypic.kernels.linear_families import DenseFamily, get_family
from hypic.kernels.varlen import Operands, RowSpans

REPO = Path(__file__).resolve().parents[1]

# below one chunk, exactly one and two chunks, ragged, empty, one token (rows of the flat batch between spans)
LENS = (5, 64, 128, 70, 0, 1, 130)
GAPS = (3, 0, 2, 1, 4, 0, 2)
GATES = {"model": lambda shape, gen: F.logsigmoid(torch.randn(*shape, generator=gen, dtype=torch.float64) + 2.0),
         "fast": lambda shape, gen: -3.0 * torch.rand(*shape, generator=gen, dtype=torch.float64),
         "slow": lambda shape, gen: -1e-3 * torch.rand(*shape, generator=gen, dtype=torch.float64)}


def interiors(lens: tuple[int, ...], gaps: tuple[int, ...], heads: tuple[int, int], dims: tuple[int, int],
              gate: str, gen: torch.Generator) -> tuple[Operands, RowSpans]:
    """float64 operands of a flat batch whose spans (after `gaps` other rows each) have lengths `lens`."""
    starts, at = [], 0
    for length, gap in zip(lens, gaps):
        starts.append(at + gap)
        at += gap + length
    rows = at + 3
    (h, hv), (kd, vd) = heads, dims
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    x = Operands(randn(rows, h, kd), F.normalize(randn(rows, h, kd), dim=-1), randn(rows, hv, vd),
                 GATES[gate]((rows, hv), gen), torch.sigmoid(randn(rows, hv)))
    return x, RowSpans.build(tuple(starts), lens, "cpu")


def as_dtype(x: Operands, dtype: torch.dtype, device: str = "cpu") -> Operands:
    """q, k, v and beta in `dtype` (the layer's), g float32, on `device`."""
    return Operands(*(t.to(device, dtype) for t in (x.q, x.k, x.v)), x.g.to(device, torch.float32),
                    x.beta.to(device, dtype))


def both(x: Operands, spans: RowSpans) -> torch.Tensor:
    return gdn_span_tuples_ref(x.k, x.v, x.g, x.beta, spans)


@pytest.mark.parametrize("gate", sorted(GATES))
def test_tuples_equal_float64_recurrence_and_the_chunk_kernel_capture(gate: str) -> None:
    family, gen = get_family("gdn"), torch.Generator().manual_seed(len(gate))
    x, spans = interiors(LENS, GAPS, (2, 4), (16, 8), gate, gen)
    T64, S064 = family.spans_tuple(x, spans)  # float64: the token recurrence
    exact = both(x, spans)  # the product in float64
    torch.testing.assert_close(exact, torch.cat([T64, S064], -1), rtol=1e-12, atol=1e-12)
    x32 = as_dtype(x, torch.float32)
    T, S0 = family.spans_tuple(x32, spans)
    kept = [b for b, length in enumerate(LENS) if length]  # the chunk kernel takes no empty span
    nonempty = RowSpans.build(tuple(spans.starts[b] for b in kept), tuple(LENS[b] for b in kept), "cpu")
    old_T, old_S0 = DenseFamily.spans_tuple(family, x32, nonempty)  # [v | 0] from [0 | I] through the chunk kernel
    assert T.dtype == S0.dtype == torch.float32 and T.shape == T64.shape and S0.shape == S064.shape
    for b, length in enumerate(LENS):
        if not length:  # an empty span: T = I, S0 = 0
            assert torch.equal(T[b], torch.eye(16).expand_as(T[b])) and not S0[b].any()
            continue
        assert rel_err(torch.cat([T[b], S0[b]], -1), exact[b]) <= 5e-6, (b, length)
        torch.testing.assert_close(T[b], old_T[kept.index(b)], rtol=0, atol=1e-5)
        torch.testing.assert_close(S0[b], old_S0[kept.index(b)], rtol=0, atol=1e-5)


def test_packed_extraction_takes_the_product() -> None:
    """`extract_tuple` (spans tiling the rows) is `spans_tuple` over packed spans."""
    family, gen = get_family("gdn"), torch.Generator().manual_seed(3)
    x, spans = interiors((70, 9), (0, 0), (1, 2), (16, 16), "model", gen)
    x32 = as_dtype(x, torch.float32)
    T, S0 = family.extract_tuple(x32.k, x32.v, x32.g, x32.beta, spans.cu_seqlens, spans.lens)
    assert torch.equal(torch.cat([T, S0], -1), both(x32, spans))


@interpreted
def test_triton_interpreted_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 inputs (the interpreter's dots of bf16 tiles return garbage; the GPU test takes bf16)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(4)
    x, spans = interiors((5, 64, 70, 0), (2, 0, 1, 3), (1, 2), (16, 24), "model", gen)
    x = as_dtype(x, torch.float32)
    out = gdn_span_tuples_triton(x.k, x.v, x.g, x.beta, spans)
    torch.testing.assert_close(out, both(x, spans), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["model", "slow"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_cpu_reference(dtype: torch.dtype, gate: str) -> None:
    """The Qwen3.5 head dims (K = V = 128, 2 value heads a key head): bf16 through the Triton kernels
    (dots in tf32), float32 through the torch reference on the GPU."""
    gen = torch.Generator().manual_seed(5)
    lens = (2048, 100, 64, 0, 1, 4100)
    x, spans = interiors(lens, (7, 1, 0, 2, 5, 3), (2, 4), (128, 128), gate, gen)
    x = as_dtype(x, dtype)
    cuda = Operands(*(t.cuda() for t in (x.q, x.k, x.v, x.g, x.beta)))
    T, S0 = get_family("gdn").spans_tuple(cuda, RowSpans.build(spans.starts, spans.lens, "cuda"))  # capture's call
    expected = both(x, spans)
    assert T.is_cuda and T.dtype == torch.float32 and T.shape == (len(lens), 4, 128, 128)
    actual = torch.cat([T, S0], -1).cpu()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for b in range(len(lens)):
        assert rel_err(actual[b], expected[b]) <= tol, (b, lens[b])


HOPPER_SHARED_BYTES = 232448  # the most dynamic shared memory one block of an H100 / H200 may opt in to


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="compiling for sm90 needs triton")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")
def test_tuple_kernels_fit_hopper_shared_memory() -> None:
    """Compiled for sm90 at Qwen3.5's heads, no GPU needed: the product's default three pipeline stages once
    asked 256 KB, and the GPU refused the launch."""
    spec = importlib.util.spec_from_file_location("kernel_resources", REPO / "scripts" / "kernel_resources.py")
    resources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resources)
    heads = argparse.Namespace(key_heads=16, value_heads=32, key_dim=128, value_dim=128)
    shared = {name: kernel.metadata.shared for name, kernel in resources.compile_tuple_kernels(heads).items()}
    assert set(shared) == {"_chunk_factor_kernel", "_ordered_product_kernel"}
    assert all(0 < size <= HOPPER_SHARED_BYTES for size in shared.values()), shared
