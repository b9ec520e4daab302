"""The kda family's chunked paths (Kimi Delta Attention, per-key gates) against its float64 token
recurrence: run, final states and tuples (dense T = the explicit product of the tokens' T_t),
and the varlen pool path a KDA layer runs (decodes and prefills, fresh and stateful slots)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from hypic.kernels.linear_families import get_family
from hypic.kernels.varlen import Operands, StateSpans
from kernel_cases import interpreted
from test_pic_algebra_families import VALUE_DIM, VALUE_HEADS, KEY_DIM, cu_of, extract, random_tokens, rel_err, span

FAMILY = get_family("kda")
LENS = [150, 0, 7, 64, 1]  # across chunk boundaries (64), empty, exactly one chunk, one token
NAMES = ("q", "k", "v", "g", "beta")


def strong_decay_tokens(length: int, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> dict:
    """Per-key gates from ~0 to ~-6 a token: inside a 64-token chunk exp(-G) would overflow float32, so
    a chunked form that divides by the decay instead of differencing log gates would fail."""
    tokens = random_tokens(FAMILY, length, gen)
    tokens["g"] = -F.softplus(torch.randn(tokens["g"].shape, generator=gen, dtype=torch.float64) * 2 + 1)
    return {n: None if x is None else x.to(dtype) for n, x in tokens.items()}


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_run_chunked_equals_token_recurrence(dtype: torch.dtype, bound: float) -> None:
    gen = torch.Generator().manual_seed(21)
    tokens = strong_decay_tokens(150, gen)
    state = torch.randn(VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen, dtype=torch.float64)
    o64, end64 = FAMILY.recur(state, *(tokens[x] for x in NAMES), scale=0.3)
    low = {n: x.to(dtype) for n, x in tokens.items()}
    o, end = FAMILY.run(state.to(dtype), *(low[x] for x in NAMES), scale=0.3)
    assert rel_err(o.double(), o64) <= bound and rel_err(end.double(), end64) <= bound


def test_final_states_and_tuples_chunked_equal_token_recurrence() -> None:
    gen = torch.Generator().manual_seed(22)
    tokens = strong_decay_tokens(sum(LENS), gen)
    tokens["g"] = tokens["g"] * 0.05  # slow decay: T is far from 0 and its error shows
    initial = torch.randn(len(LENS), VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen, dtype=torch.float64)
    bounds = list(itertools.pairwise(itertools.accumulate(LENS, initial=0)))
    truth = [FAMILY.recur(initial[b], *(span(tokens, *se)[x] for x in NAMES), scale=1.0)[1]
             for b, se in enumerate(bounds)]
    low = {n: x.float() for n, x in tokens.items()}
    ends = FAMILY.final_states(low["k"], low["v"], low["g"], low["beta"], initial.float(), cu_of(LENS), tuple(LENS))
    assert rel_err(ends.double(), torch.stack(truth)) <= 1e-5
    T, S0 = extract(FAMILY, low, LENS)
    eye = torch.eye(KEY_DIM, dtype=torch.float64).expand(VALUE_HEADS, -1, -1)
    for b, (start, end) in enumerate(bounds):
        product = eye
        for t in range(start, end):
            product = FAMILY.token_T(tokens["k"][t].repeat_interleave(2, 0), tokens["g"][t], tokens["beta"][t]) @ product
        zero_end = FAMILY.recur(torch.zeros_like(initial[0]), *(span(tokens, start, end)[x] for x in NAMES),
                                scale=1.0)[1]
        assert rel_err(T[b].double(), product) <= 1e-5
        assert end == start or rel_err(S0[b].double(), zero_end) <= 1e-5


def test_recur_spans_reads_and_writes_the_pool() -> None:
    """Two decodes first, then prefills from a slot's state or from zeros; end states written back,
    a slot no span names untouched (a fresh span's slot holds nan)."""
    gen = torch.Generator().manual_seed(23)
    lens, slots, has_state = [1, 1, 70, 5], [4, 2, 0, 3], [True, True, True, False]
    tokens = strong_decay_tokens(sum(lens), gen, torch.float32)
    pool = torch.randn(5, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    pool[3] = float("nan")
    before = pool.double().clone()
    spans = StateSpans(torch.tensor(slots), torch.tensor(has_state), cu_of(lens), 2, tuple(lens))
    o = FAMILY.recur_spans(Operands(*(tokens[n] for n in NAMES)), pool, spans, scale=0.5)
    for b, (start, end) in enumerate(itertools.pairwise(itertools.accumulate(lens, initial=0))):
        init = before[slots[b]] if has_state[b] else torch.zeros_like(before[0])
        part = {n: t.double() for n, t in span(tokens, start, end).items()}
        o64, end64 = FAMILY.recur(init, *(part[n] for n in NAMES), scale=0.5)
        assert rel_err(o[start:end].double(), o64) <= 1e-5 and rel_err(pool[slots[b]].double(), end64) <= 1e-5
    assert torch.equal(pool[1].double(), before[1])


def decode_case(seed: int, device: str = "cpu"):
    """Three decodes (value heads sharing key heads 2:1), one from a fresh slot holding nan."""
    gen = torch.Generator().manual_seed(seed)
    tokens = strong_decay_tokens(3, gen, torch.float32)
    pool = torch.randn(6, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    slots, has_state = torch.tensor([5, 1, 3]), torch.tensor([True, False, True])
    pool[1] = float("nan")
    return ([tokens[n].to(device) for n in NAMES], pool.to(device), slots.to(device), has_state.to(device))


@interpreted
def test_triton_decode_interpreted_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from hypic.kernels.kda_rule import kda_decode_triton, kda_rule_ref

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, pool, slots, has_state = decode_case(24)
    expected_pool = pool.clone()
    expected = kda_rule_ref(*x, expected_pool, slots, has_state, cu_of([1, 1, 1]), scale=0.4, num_decodes=3,
                            seq_lens_cpu=(1, 1, 1))
    out = torch.empty_like(x[2])
    kda_decode_triton(*x, pool, slots, has_state, scale=0.4, out=out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_decodes_and_prefills_match_the_cpu_path(dtype: torch.dtype, bound: float) -> None:
    """Two decodes (Triton) beside prefills from a slot's state and from zeros (FLA's chunk_kda in
    bf16, the chunked reference in float32), at Kimi's head size."""
    gen = torch.Generator().manual_seed(25)
    lens, slots, has_state = [1, 1, 70, 130], torch.tensor([4, 2, 0, 1]), torch.tensor([True, True, False, True])
    heads, dim = 2, 128
    tokens = random_tokens(FAMILY, sum(lens), gen, dtype=torch.float32, heads=(heads, heads), dims=(dim, dim))
    pool = torch.randn(5, heads, dim, dim, generator=gen) * 0.1
    spans = StateSpans(slots, has_state, cu_of(lens), 2, tuple(lens))
    expected_pool = pool.clone()
    low = {n: t.to(dtype) if n != "g" else t for n, t in tokens.items()}  # the gate stays float32
    expected = FAMILY.recur_spans(Operands(*(low[n].float() for n in NAMES)), expected_pool, spans, scale=dim ** -0.5)
    cuda_pool = pool.cuda()
    cuda_spans = StateSpans(slots.cuda(), has_state.cuda(), cu_of(lens).cuda(), 2, tuple(lens))
    o = FAMILY.recur_spans(Operands(*(low[n].cuda() for n in NAMES)), cuda_pool, cuda_spans, scale=dim ** -0.5)
    assert rel_err(o.cpu().double(), expected.double()) <= bound
    assert rel_err(cuda_pool.cpu().double(), expected_pool.double()) <= bound
