"""compose_and_recur: a batch of requests walking cached tuples and recompute tokens (DESIGN §3.5).

Oracle: each request's whole token sequence (cached interiors included) run token by token from
its initial state; the walk must give the same outputs at recompute tokens and the same end state.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from hypic.kernels.compose import CachedPieces, compose_and_recur, compose_and_recur_ref, compose_and_recur_triton
from hypic.kernels.linear_families import LinearFamily, get_family
from tests.test_pic_algebra_families import FAMILY_NAMES, random_tokens, rel_err, span

SCALE = 0.7
# (pieces, has_state): ("c", n) = n recompute tokens, ("t", n) = a cached tuple over n tokens
REQUESTS: tuple[tuple[tuple[tuple[str, int], ...], bool], ...] = (
    ((("c", 3), ("t", 6), ("c", 4), ("t", 5), ("t", 3), ("c", 2)), True),
    ((("t", 7), ("c", 5)), False),  # starts on a tuple from zero
    ((("c", 4), ("t", 5)), True),  # chunk ends on a tuple
    ((("c", 6),), False),  # an ordinary prefill
    ((("t", 4), ("t", 4)), True),  # no tokens this step
)


@dataclass
class Case:
    """Inputs of compose_and_recur plus the oracle's outputs (recompute rows) and end states."""

    inputs: dict
    pool: torch.Tensor
    expected_o: torch.Tensor
    expected_states: torch.Tensor


def build_case(family: LinearFamily, gen: torch.Generator, dtype: torch.dtype = torch.float64,
               heads: tuple[int, int] = (2, 4), dims: tuple[int, int] = (8, 6),
               tuple_dtype: torch.dtype | None = None) -> Case:
    hv, (kd, vd) = heads[1], dims
    flat, outs, ends, rows, t_parts, s0_parts, inits = [], [], [], [], [], [], []
    cursor = t_len = s0_len = 0
    for pieces, has_state in REQUESTS:
        tokens = random_tokens(family, sum(n for _, n in pieces), gen, dtype, heads, dims)
        init = torch.randn(hv, kd, vd, generator=gen, dtype=torch.float64) if has_state else torch.zeros(hv, kd, vd, dtype=torch.float64)
        o, end = family.recur(init, *(_as64(tokens[n]) for n in ("q", "k", "v", "g", "beta")), scale=SCALE)
        request_rows, offset = [], 0
        for kind, n in pieces:
            part = span(tokens, offset, offset + n)
            if kind == "c":
                flat.append(part)
                outs.append(o[offset: offset + n])
                cursor += n
            else:
                T, S0 = family.extract_tuple(*(_as64(part[x]) for x in ("k", "v", "g", "beta")), torch.tensor([0, n]))
                request_rows.append((cursor, t_len, s0_len))
                t_parts.append(T.flatten())
                s0_parts.append(S0.flatten())
                t_len, s0_len = t_len + T.numel(), s0_len + S0.numel()
            offset += n
        rows.append(request_rows)
        ends.append(end)
        inits.append(init)
    return _assemble(flat, outs, ends, rows, t_parts, s0_parts, inits, dtype, tuple_dtype, family)


def _assemble(flat, outs, ends, rows, t_parts, s0_parts, inits, dtype, tuple_dtype, family) -> Case:
    num = len(REQUESTS)
    lens = [sum(n for kind, n in pieces if kind == "c") for pieces, _ in REQUESTS]
    has_state = torch.tensor([h for _, h in REQUESTS])
    slots = torch.tensor([5, 0, 3, 6, 1])[:num]
    pool_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    pool = torch.full((8, *inits[0].shape), float("nan"), dtype=pool_dtype)  # stale slots must not leak
    pool[slots[has_state]] = torch.stack(inits)[has_state].to(pool_dtype)
    cat = {name: None if flat[0][name] is None else torch.cat([p[name] for p in flat]) for name in flat[0]}
    t_dtype = torch.float32 if family.log_T and dtype != torch.float64 else (tuple_dtype or dtype)
    inputs = dict(**cat, slots=slots, has_state=has_state,
                  cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
                  pieces=CachedPieces.build(rows), t_src=torch.cat(t_parts).to(t_dtype),
                  s0_src=torch.cat(s0_parts).to(tuple_dtype or dtype))
    return Case(inputs, pool, torch.cat(outs), torch.stack(ends))


def _as64(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.double()


def run(case: Case, family: LinearFamily, fn=compose_and_recur, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    moved = {name: _to(x, device) for name, x in case.inputs.items()}
    pool = case.pool.to(device)
    o = fn(moved["q"], moved["k"], moved["v"], moved["g"], moved["beta"], pool, moved["slots"], moved["has_state"],
           moved["cu_seqlens"], moved["pieces"], moved["t_src"], moved["s0_src"], family=family, scale=SCALE)
    return o.cpu(), pool[case.inputs["slots"].to(device)].cpu()


def _to(x, device: str):
    if isinstance(x, CachedPieces):
        return CachedPieces(*(getattr(x, f).to(device) for f in ("ptr", "at", "t_off", "s0_off")))
    return None if x is None else x.to(device)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_reference_walk_equals_sequential_recurrence(name: str) -> None:
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(0))
    o, states = run(case, family)
    assert rel_err(o, case.expected_o) <= 1e-10
    assert rel_err(states, case.expected_states) <= 1e-10


def test_pieces_table_layout() -> None:
    pieces = CachedPieces.build([[(0, 10, 20)], [], [(5, 30, 40), (7, 50, 60)]])
    assert pieces.ptr.tolist() == [0, 1, 1, 3] and pieces.at.tolist() == [0, 5, 7]
    assert pieces.shifted(1, 2).t_off.tolist() == [11, 31, 51] and pieces.num_pieces == 3
    assert CachedPieces.empty(2).ptr.tolist() == [0, 0, 0]


def test_bf16_tuples_stay_close() -> None:
    family = get_family("gdn")
    case = build_case(family, torch.Generator().manual_seed(1), dtype=torch.float32, tuple_dtype=torch.bfloat16)
    o, states = run(case, family)
    assert rel_err(o.double(), case.expected_o) <= 2e-2
    assert rel_err(states.double(), case.expected_states) <= 2e-2


@pytest.mark.skipif(os.environ.get("HYPIC_TRITON_INTERPRET") != "1", reason="set HYPIC_TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_triton_kernel_interpreted_matches_reference(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(2), dtype=torch.float32)
    o, states = run(case, family, compose_and_recur_triton)
    o_ref, states_ref = run(case, family, compose_and_recur_ref)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(states, states_ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("tuple_dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_on_gpu_matches_reference(name: str, tuple_dtype: torch.dtype) -> None:
    """Qwen3-Next shapes (16 key heads, 32 value heads, K = V = 128), bf16 tokens."""
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(3), dtype=torch.bfloat16, heads=(16, 32),
                      dims=(128, 128), tuple_dtype=tuple_dtype)
    o, states = run(case, family, compose_and_recur, device="cuda")
    o_ref, states_ref = run(case, family, compose_and_recur_ref, device="cuda")
    assert rel_err(o.float(), o_ref.float()) <= 1e-2  # bf16 outputs
    assert rel_err(states, states_ref) <= 1e-4
