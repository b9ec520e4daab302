"""The PIC walk kernel's launch shapes: every shape the engine may pick gives the reference's walk.

The walks are those of test_pic_algebra_compose (requests mixing cached tuples and recompute
tokens); here the heads have several V tiles and K spans several compose chunks, so every tiling
and the chunked dense compose meet their masks. The interpreter runs one program's whole tile at
once, so num_warps only matters on a GPU (the gpu tests sweep it).
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hypic.kernels.compose import (WalkConfig, _share_lines, _tf32_high, compose_and_recur_ref,
                                   compose_and_recur_triton)
from hypic.kernels.linear_families import get_family
from hypic.kernels.triton_lazy import triton_kernel
from kernel_cases import interpreted, rel_err
from tests.test_pic_algebra_compose import Case, build_case, run, run_with_checkpoints

tl: Any  # triton.language, bound by triton_lazy on first use

HEADS, DIMS = (1, 2), (40, 20)  # K = 40: a full and a masked compose chunk of 32; V = 20: masked V tiles


def walk_with(config: WalkConfig):
    return functools.partial(compose_and_recur_triton, config=config)


@interpreted
@pytest.mark.parametrize("block_v", [8, 16, 32])
def test_interpreted_tiling_matches_reference(block_v: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    family = get_family("gdn")
    case = build_case(family, torch.Generator().manual_seed(6), dtype=torch.float32, heads=HEADS, dims=DIMS)
    o, states = run(case, family, walk_with(WalkConfig(block_v=block_v, num_warps=1)))
    o_ref, states_ref = run(case, family, compose_and_recur_ref)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(states, states_ref) <= 1e-5


@interpreted
@pytest.mark.parametrize("name", ["kda", "diagonal"])
def test_interpreted_chunked_compose_keeps_checkpoints(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other gate shapes through a narrow tile, with the state saved before each last token."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(7), dtype=torch.float32, heads=HEADS, dims=DIMS)
    o, states, saved = run_with_checkpoints(case, family, walk_with(WalkConfig(block_v=8, num_warps=1)))
    o_ref, states_ref, saved_ref = run_with_checkpoints(case, family, compose_and_recur_ref)
    assert rel_err(saved, saved_ref) <= 1e-5
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(states, states_ref) <= 1e-5


@pytest.fixture
def interpreted_bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter multiplies a bf16 dot operand's bit patterns (triton-lang/triton#11584, left
    unsupported): widen bf16 operands to float32 first, exact, as a tensor core's products are."""
    import triton.language as language
    from triton.runtime.interpreter import InterpreterBuilder

    create_dot = InterpreterBuilder.create_dot

    def widened(builder: InterpreterBuilder, a: Any, b: Any, *rest: Any) -> Any:
        a, b = (builder.cast_impl(x, language.float32) if x.dtype == language.bfloat16 else x for x in (a, b))
        return create_dot(builder, a, b, *rest)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", widened)


@interpreted
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_interpreted_bf16_tuples_match_reference(name: str, monkeypatch: pytest.MonkeyPatch,
                                                 interpreted_bf16_dot: None) -> None:
    """A bf16 T goes to the MMA as it is, against S in two bf16 parts. The interpreter's casts to bf16
    truncate, so S's parts err ~1e-5 here (rounded to nearest as on a GPU, ~3e-6); S in one part
    errs ~4e-3, in three (or T split as a float32 T is) ~2e-7."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(11), dtype=torch.float32, heads=HEADS, dims=DIMS,
                      tuple_dtype=torch.bfloat16)
    o, states, saved = run_with_checkpoints(case, family, walk_with(WalkConfig(block_v=8, num_warps=1)))
    o_ref, states_ref, saved_ref = run_with_checkpoints(case, family, compose_and_recur_ref)
    assert rel_err(saved, saved_ref) <= 3e-5
    assert rel_err(o, o_ref) <= 3e-5 and rel_err(states, states_ref) <= 3e-5


@triton_kernel
def _split_kernel(x, high, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(high + offsets, _tf32_high(tl.load(x + offsets)))


@interpreted
def test_tf32_split_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """high keeps tf32's 10 mantissa bits (the low 13 are zero) and x - high is exact and small."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(256, generator=torch.Generator().manual_seed(8)) * torch.logspace(-20, 20, 256)
    high = torch.empty_like(x)
    _split_kernel[(1,)](x, high, N=256)
    assert not (high.view(torch.int32) & 0x1FFF).any()
    low = x - high
    assert torch.equal(high + low, x) and bool((low.abs() <= x.abs() * 2.0 ** -10).all())


@triton_kernel
def _share_kernel(out, LINES: tl.constexpr, NV: tl.constexpr, STEPS: tl.constexpr):
    i_v = tl.program_id(0)
    for m in tl.static_range(0, STEPS * 32, 32):
        tl.store(out + i_v * STEPS * 32 + m + tl.arange(0, 32), _share_lines(m, i_v, LINES, NV))


@interpreted
@pytest.mark.parametrize(("lines", "programs"), [(256, 16), (1, 16), (7, 3), (100, 3)])
def test_prefetch_shares_cover_every_line_within_the_block(lines: int, programs: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The V tiles of a head prefetch a tuple's lines between them (a scalar T is one line; 100 lines
    on 3 programs take two steps of 32): every line, and none past the block."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    per_program = -(-lines // programs)
    steps = -(-per_program // 32)  # as _prefetch_share's static_range takes them
    out = torch.full((programs, steps * 32), -1, dtype=torch.int32)
    _share_kernel[(programs,)](out, LINES=lines, NV=programs, STEPS=steps)
    assert set(out.flatten().tolist()) == set(range(lines))


def test_launch_shape_must_be_powers_of_two() -> None:
    with pytest.raises(ValueError, match="block_v"):
        WalkConfig(block_v=12, num_warps=1)
    with pytest.raises(ValueError, match="num_warps"):
        WalkConfig(block_v=8, num_warps=3)


def test_state_pool_must_be_float32() -> None:
    """The walk parks composed rows in the request's slot: a float64 pool is the reference's alone."""
    family = get_family("gdn")
    case = build_case(family, torch.Generator().manual_seed(9))
    with pytest.raises(TypeError, match="float32"):
        run(case, family, compose_and_recur_triton)


@functools.cache
def gpu_case(name: str) -> tuple[Case, tuple[torch.Tensor, ...]]:
    """Qwen3.5 head dims (K = V = 128; 4 value heads on 2 key heads keep the float64 oracle quick),
    with the reference's walk computed once for every launch shape. The reference runs on the CPU:
    on cuda its GDN spans would run FLA's chunk kernel (bf16 matmuls, ~1e-3)."""
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(10), dtype=torch.bfloat16, heads=(2, 4),
                      dims=(128, 128))
    return case, run_with_checkpoints(case, family, compose_and_recur_ref, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(("block_v", "num_warps"), [(8, 1), (8, 2), (16, 1), (16, 2), (32, 4), (32, 8)])
@pytest.mark.parametrize("name", ["gdn", "diagonal"])
def test_gpu_launch_shapes_match_reference(name: str, block_v: int, num_warps: int) -> None:
    """The state bound holds the dense compose to float32 accuracy (tf32 alone costs ~1e-3)."""
    case, (o_ref, states_ref, saved_ref) = gpu_case(name)
    walk = walk_with(WalkConfig(block_v=block_v, num_warps=num_warps))
    o, states, saved = run_with_checkpoints(case, get_family(name), walk, device="cuda")
    assert rel_err(o.float(), o_ref.float()) <= 1e-2  # bf16 outputs
    assert rel_err(states, states_ref) <= 1e-4 and rel_err(saved, saved_ref) <= 1e-4
