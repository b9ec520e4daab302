"""The log-gate families' closed-form tuples (`span_tuples`) against the float64 token recurrence."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from test_pic_algebra_families import cu_of, extract, random_tokens_as, rel_err

from hypic.kernels import span_states as span_states_module
from hypic.kernels.linear_families import get_family
from hypic.kernels.span_states import span_tuples
from hypic.kernels.varlen import RowSpans

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 8, 16, 8  # 4 value heads per key head (GVA / n_groups)
# (length, log-gate scale): slow decay over a long span (G ~ -0.3), fast decay (G ~ -1.5e4, where
# float32 cumulative sums would err by ~1e-3 in the exponent), empty, one token, moderate
SPANS = [(3000, 1e-4), (5000, 3.0), (0, 1.0), (1, 1.0), (700, 0.05)]
LENS = [length for length, _ in SPANS]


def gated_tokens(name: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """float32 operands (k unit-norm per key head) with each span's gates at its own scale."""
    per_key = get_family(name).gate_per_key
    k = F.normalize(torch.randn(sum(LENS), KEY_HEADS, KEY_DIM, generator=gen), dim=-1)
    v = torch.randn(sum(LENS), VALUE_HEADS, VALUE_DIM, generator=gen)
    gates = []
    for length, scale in SPANS:
        shape = (length, VALUE_HEADS, KEY_DIM) if per_key else (length, VALUE_HEADS)
        gates.append(-scale * torch.rand(*shape, generator=gen))
    return {"k": k, "v": v, "g": torch.cat(gates), "beta": None}


def span_states(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, cu: torch.Tensor, lens: tuple[int, ...]):
    """S0 of the spans of a packed batch."""
    return span_tuples(k, v, g, RowSpans.packed(cu, lens))[1]


as64 = functools.partial(random_tokens_as, dtype=torch.float64)


@pytest.mark.parametrize("name", ["scalar", "diagonal"])
def test_closed_form_equals_float64_recurrence_per_span(name: str) -> None:
    family, gen = get_family(name), torch.Generator().manual_seed(21)
    tokens = gated_tokens(name, gen)
    exact_T, truth = extract(family, as64(tokens), LENS)  # float64: the token recurrence
    S0 = span_states(tokens["k"], tokens["v"], tokens["g"], cu_of(LENS), tuple(LENS))
    assert S0.dtype == torch.float32 and S0.shape == truth.shape
    for b, length in enumerate(LENS):
        if length:
            assert rel_err(S0[b].double(), truth[b]) <= 1e-5, (b, SPANS[b])
        else:
            assert not S0[b].any()
    T, tuple_S0 = extract(family, tokens, LENS)  # float32 tuples take the closed form
    assert torch.equal(tuple_S0, S0) and rel_err(T.double(), exact_T) <= 1e-5


@pytest.mark.parametrize("name", ["scalar", "diagonal"])
def test_final_states_from_an_initial_state_compose_the_closed_form(name: str) -> None:
    family, gen = get_family(name), torch.Generator().manual_seed(22)
    tokens = gated_tokens(name, gen)
    initial = torch.randn(len(LENS), VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    truth = family.final_states(*(as64(tokens)[n] for n in ("k", "v", "g", "beta")), initial.double(),
                                cu_of(LENS), tuple(LENS))
    ends = family.final_states(tokens["k"], tokens["v"], tokens["g"], None, initial, cu_of(LENS), tuple(LENS))
    assert rel_err(ends.double(), truth) <= 1e-5
    assert rel_err(ends[2].double(), initial[2].double()) == 0.0  # an empty span keeps its state


@pytest.mark.parametrize("name", ["scalar", "diagonal"])
def test_spans_are_read_in_place_between_other_rows(name: str) -> None:
    """Spans at their rows of a flat batch with other rows around them (seams, other sequences) give the
    tuples of the same spans packed: nothing outside a span is read into it."""
    tokens = gated_tokens(name, torch.Generator().manual_seed(26))
    packed = span_tuples(tokens["k"], tokens["v"], tokens["g"], RowSpans.packed(cu_of(LENS), tuple(LENS)))
    gap, starts, pieces = 5, [], []
    for (start, end), length in zip(itertools.pairwise(itertools.accumulate(LENS, initial=0)), LENS):
        starts.append(sum(len(p["v"]) for p in pieces) + gap)
        noise = {n: 1e3 * torch.ones_like(tokens[n][:gap]) for n in ("k", "v", "g")}
        pieces += [noise, {n: tokens[n][start:end] for n in ("k", "v", "g")}]
    flat = {n: torch.cat([p[n] for p in pieces]) for n in ("k", "v", "g")}
    spaced = span_tuples(flat["k"], flat["v"], flat["g"], RowSpans.build(tuple(starts), tuple(LENS), "cpu"))
    assert torch.equal(spaced[0], packed[0]) and torch.equal(spaced[1], packed[1])


def test_long_spans_run_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of at most ROW_BLOCK_ELEMENTS / (HV max(K, V)) rows, their states summed: other sums, same states."""
    tokens = gated_tokens("scalar", torch.Generator().manual_seed(23))
    whole = span_states(tokens["k"], tokens["v"], tokens["g"], cu_of(LENS), tuple(LENS))
    monkeypatch.setattr(span_states_module, "ROW_BLOCK_ELEMENTS", 333 * VALUE_HEADS * KEY_DIM)  # 333-row pieces
    blocked = span_states(tokens["k"], tokens["v"], tokens["g"], cu_of(LENS), tuple(LENS))
    assert rel_err(blocked, whole) <= 1e-6 and not torch.equal(blocked, whole)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["scalar", "diagonal"])
def test_closed_form_on_gpu_from_bf16_inputs(name: str) -> None:
    """bf16 k and v (float32 gates) as a Mamba2 layer gives them, through the tensor cores: the
    weighted operand is rounded to bf16 (2^-9 relative each), so within 2^-8 of the float64
    recurrence over the same bf16 values."""
    family, gen = get_family(name), torch.Generator().manual_seed(24)
    tokens = gated_tokens(name, gen)
    tokens["k"], tokens["v"] = tokens["k"].bfloat16(), tokens["v"].bfloat16()
    _, truth = extract(family, as64(tokens), LENS)
    cuda = {n: None if x is None else x.cuda() for n, x in tokens.items()}
    S0 = span_states(cuda["k"], cuda["v"], cuda["g"], cu_of(LENS).cuda(), tuple(LENS))
    assert rel_err(S0.double().cpu(), truth) <= 2 ** -8


def test_negligible_weights_are_zero_not_subnormal() -> None:
    """A fast-decay span's early weights underflow float32: they are dropped below 2^-64, never left as
    subnormals (which slow a CPU GEMM some 30x); the last token of every span weighs exactly 1."""
    tokens = gated_tokens("scalar", torch.Generator().manual_seed(25))
    spans = RowSpans.packed(cu_of(LENS), tuple(LENS))
    decay = span_states_module._decay_to_span_end(span_states_module._cumulative_gates(tokens["g"], spans), spans)
    assert ((decay == 0) | (decay >= 2.0 ** -64)).all() and (decay == 0).any()
    last_rows = cu_of(LENS)[1:][torch.tensor(LENS) > 0].long() - 1
    assert torch.equal(decay[last_rows], torch.ones_like(decay[last_rows]))


@pytest.mark.gpu
def test_in_place_spans_on_gpu_from_strided_bf16_rows() -> None:
    """As a Mamba2 layer hands them over: B (k) a view into the wider conv output, bf16 k and v, the
    spans between other rows; the tensor-core path against the float64 recurrence of the same values."""
    family, gen = get_family("scalar"), torch.Generator().manual_seed(27)
    tokens = gated_tokens("scalar", gen)
    tokens["k"], tokens["v"] = tokens["k"].bfloat16(), tokens["v"].bfloat16()
    _, truth = extract(family, as64(tokens), LENS)
    gap, n = 3, sum(LENS) + 3 * len(LENS)
    starts = [gap * (b + 1) + sum(LENS[:b]) for b in range(len(LENS))]
    rows = torch.cat([torch.arange(s, s + length) for s, length in zip(starts, LENS)])
    wide = torch.full((n, KEY_HEADS * KEY_DIM + 40), 1e3, dtype=torch.bfloat16)
    wide[rows, :KEY_HEADS * KEY_DIM] = tokens["k"].flatten(1)
    flat = {"v": torch.full((n, VALUE_HEADS, VALUE_DIM), 1e3, dtype=torch.bfloat16),
            "g": torch.full((n, VALUE_HEADS), -1.0)}
    flat["v"][rows], flat["g"][rows] = tokens["v"], tokens["g"]
    k = wide.cuda()[:, :KEY_HEADS * KEY_DIM].view(n, KEY_HEADS, KEY_DIM)
    T, S0 = span_tuples(k, flat["v"].cuda(), flat["g"].cuda(), RowSpans.build(tuple(starts), tuple(LENS), "cuda"))
    assert rel_err(S0.double().cpu(), truth) <= 2 ** -8
    assert rel_err(T.double().cpu(), extract(family, as64(tokens), LENS)[0]) <= 1e-6
