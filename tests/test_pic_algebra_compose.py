"""compose_and_recur: a batch of requests walking cached tuples and recompute tokens (DESIGN §3.5).

Oracle: each request's whole token sequence (cached interiors included) run token by token from
its initial state; the walk must give the same outputs at recompute tokens and the same end state.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch

from hypic.kernels.compose import (CachedPieces, StateCheckpoints, compose_and_recur, compose_and_recur_ref,
                                   compose_and_recur_triton)
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
    ((("c", 37), ("t", 6), ("c", 16), ("t", 3), ("c", 21)), True),  # spans of several kernel chunks
)


@dataclass
class Case:
    """Inputs of compose_and_recur plus the oracle's outputs (recompute rows) and end states."""

    inputs: dict
    pool: torch.Tensor
    expected_o: torch.Tensor
    expected_states: torch.Tensor
    before_last: list[torch.Tensor | None]  # per request ending on recompute tokens: the state before its last


def build_case(family: LinearFamily, gen: torch.Generator, dtype: torch.dtype = torch.float64,
               heads: tuple[int, int] = (2, 4), dims: tuple[int, int] = (8, 6),
               tuple_dtype: torch.dtype | None = None) -> Case:
    builder = _CaseBuilder(family)
    for pieces, has_state in REQUESTS:
        tokens = random_tokens(family, sum(n for _, n in pieces), gen, dtype, heads, dims)
        state_shape = (heads[1], *dims[:1], dims[1])
        init = torch.randn(*state_shape, generator=gen, dtype=torch.float64) * has_state
        builder.add_request(pieces, tokens, init)
    return builder.finish(dtype, tuple_dtype)


class _CaseBuilder:
    """Lays requests out as compose_and_recur wants them: recompute tokens flat, tuples flat."""

    def __init__(self, family: LinearFamily) -> None:
        self.family = family
        self.flat, self.outs, self.ends, self.inits, self.rows, self.before_last = [], [], [], [], [], []
        self.t_parts, self.s0_parts = [], []
        self.cursor = self.t_len = self.s0_len = 0

    def add_request(self, pieces: tuple[tuple[str, int], ...], tokens: dict, init: torch.Tensor) -> None:
        o, end = self.family.recur(init, *_fields64(tokens, ("q", "k", "v", "g", "beta")), scale=SCALE)
        head = span(tokens, 0, sum(n for _, n in pieces) - 1)
        self.before_last.append(self.family.recur(init, *_fields64(head, ("q", "k", "v", "g", "beta")), scale=SCALE)[1]
                                if pieces[-1][0] == "c" else None)
        self.rows.append([])
        offset = 0
        for kind, n in pieces:
            part = span(tokens, offset, offset + n)
            if kind == "c":
                self.flat.append(part)
                self.outs.append(o[offset: offset + n])
                self.cursor += n
            else:
                self._add_tuple(part, n)
            offset += n
        self.ends.append(end)
        self.inits.append(init)

    def _add_tuple(self, part: dict, n: int) -> None:
        T, S0 = self.family.extract_tuple(*_fields64(part, ("k", "v", "g", "beta")), torch.tensor([0, n]), (n,))
        self.rows[-1].append((self.cursor, self.t_len, self.s0_len))
        self.t_parts.append(T.flatten())
        self.s0_parts.append(S0.flatten())
        self.t_len, self.s0_len = self.t_len + T.numel(), self.s0_len + S0.numel()

    def finish(self, dtype: torch.dtype, tuple_dtype: torch.dtype | None) -> Case:
        lens = [sum(n for kind, n in pieces if kind == "c") for pieces, _ in REQUESTS]
        has_state = torch.tensor([h for _, h in REQUESTS])
        slots = torch.tensor([5, 0, 3, 6, 1, 7])
        pool_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        pool = torch.full((8, *self.inits[0].shape), float("nan"), dtype=pool_dtype)  # stale slots must not leak
        pool[slots[has_state]] = torch.stack(self.inits)[has_state].to(pool_dtype)
        cat = {name: None if x is None else torch.cat([p[name] for p in self.flat])
               for name, x in self.flat[0].items()}
        t_dtype = torch.float32 if self.family.log_T and dtype != torch.float64 else (tuple_dtype or dtype)
        inputs = dict(**cat, slots=slots, has_state=has_state,
                      cu_seqlens=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32),
                      pieces=CachedPieces.build(self.rows), t_src=torch.cat(self.t_parts).to(t_dtype),
                      s0_src=torch.cat(self.s0_parts).to(tuple_dtype or dtype))
        return Case(inputs, pool, torch.cat(self.outs), torch.stack(self.ends), self.before_last)


def _fields64(tokens: dict, names: tuple[str, ...]) -> list[torch.Tensor | None]:
    return [None if tokens[n] is None else tokens[n].double() for n in names]


def run(case: Case, family: LinearFamily, fn=compose_and_recur, device: str = "cpu"
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs, end states of the requests' slots); the case's pool is left untouched."""
    x = {name: _to(value, device) for name, value in case.inputs.items()}
    pool = case.pool.to(device, copy=True)
    o = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, x["slots"], x["has_state"], x["cu_seqlens"],
           x["pieces"], x["t_src"], x["s0_src"], family=family, scale=SCALE)
    return o.cpu(), pool[case.inputs["slots"].to(device)].cpu()


def run_with_checkpoints(case: Case, family: LinearFamily, fn, device: str = "cpu"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`run` where every request ending on recompute tokens keeps the state before its last token in
    slot 8 + b; returns (outputs, end states, saved states of those requests)."""
    x = {name: _to(value, device) for name, value in case.inputs.items()}
    saving = [b for b, before in enumerate(case.before_last) if before is not None]
    ends = case.inputs["cu_seqlens"][1:].tolist()
    at = torch.tensor([ends[b] - 1 if b in saving else -1 for b in range(len(ends))])
    save_slots = torch.arange(len(ends)) + case.pool.shape[0]
    pool = torch.cat([case.pool, torch.full_like(case.pool[: len(ends)], float("nan"))]).to(device)
    o = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, x["slots"], x["has_state"], x["cu_seqlens"],
           x["pieces"], x["t_src"], x["s0_src"], family=family, scale=SCALE,
           checkpoints=StateCheckpoints(at.to(device), save_slots.to(device)))
    return o.cpu(), pool[case.inputs["slots"].to(device)].cpu(), pool[save_slots[saving].to(device)].cpu()


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


def test_reference_walk_in_float32_runs_chunked_gdn_spans() -> None:
    family = get_family("gdn")
    case = build_case(family, torch.Generator().manual_seed(4), dtype=torch.float32)
    o, states = run(case, family)
    assert rel_err(o.double(), case.expected_o) <= 1e-5
    assert rel_err(states.double(), case.expected_states) <= 1e-5


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_reference_walk_keeps_the_state_before_the_last_token(name: str) -> None:
    """A checkpoint one token short of the chunk's end: outputs and end states unchanged."""
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(5))
    o, states, saved = run_with_checkpoints(case, family, compose_and_recur_ref)
    expected = torch.stack([s for s in case.before_last if s is not None])
    assert rel_err(saved, expected) <= 1e-10
    assert rel_err(o, case.expected_o) <= 1e-10 and rel_err(states, case.expected_states) <= 1e-10


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
    o, states, saved = run_with_checkpoints(case, family, compose_and_recur_triton)
    o_ref, states_ref, saved_ref = run_with_checkpoints(case, family, compose_and_recur_ref)
    assert rel_err(saved, saved_ref) <= 1e-5
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(states, states_ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("tuple_dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_on_gpu_matches_reference(name: str, tuple_dtype: torch.dtype) -> None:
    """Qwen3-Next head shapes (K = V = 128; 4 value heads on 2 key heads keep the float64 oracle quick)."""
    family = get_family(name)
    case = build_case(family, torch.Generator().manual_seed(3), dtype=torch.bfloat16, heads=(2, 4),
                      dims=(128, 128), tuple_dtype=tuple_dtype)
    o, states = run(case, family, compose_and_recur, device="cuda")
    # the reference on the CPU: on cuda its GDN spans would run FLA's chunk kernel (bf16 matmuls, ~1e-3)
    o_ref, states_ref = run(case, family, compose_and_recur_ref, device="cpu")
    assert rel_err(o.float(), o_ref.float()) <= 1e-2  # bf16 outputs
    assert rel_err(states, states_ref) <= 1e-4
    _, _, saved = run_with_checkpoints(case, family, compose_and_recur, device="cuda")
    _, _, saved_ref = run_with_checkpoints(case, family, compose_and_recur_ref, device="cpu")
    assert rel_err(saved, saved_ref) <= 1e-4
