"""The per-layer PIC recurrence of any family (hypic.kernels.pic_layer): a walk over cached pieces,
then the family's chunked path for the rows after it, against the float64 token recurrence."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.compose import CachedPieces, StateCheckpoints
from hypic.kernels.linear_families import get_family
from hypic.kernels.pic_layer import assembled_recurrence, segment_tuple
from hypic.kernels.varlen import Operands, RowSpans, StateSpans
from tests.test_pic_algebra_families import KEY_DIM, VALUE_DIM, VALUE_HEADS, cu_of, random_tokens, rel_err, span

NAMES = ("q", "k", "v", "g", "beta")
SCALE = 0.4


def spans(starts: list[int], lens: list[int]) -> RowSpans:
    return RowSpans.build(tuple(starts), tuple(lens), "cpu")


def operands(tokens: dict, dtype: torch.dtype = torch.float32) -> Operands:
    return Operands(*(None if tokens[n] is None else tokens[n].to(dtype) for n in NAMES))


def cat(*parts: dict) -> dict:
    return {n: None if parts[0][n] is None else torch.cat([p[n] for p in parts]) for n in NAMES}


@pytest.mark.parametrize("name", ["scalar", "gdn"])
def test_walk_then_chunked_rest_equals_the_token_recurrence(name: str) -> None:
    """Rows [A: 10 tokens | B: 5 tokens]. A composes one cached 30-token segment after its 4th token and
    walks to its 6th; its last 4 tokens and all of B (from its slot's state) take the family's chunked
    path. Truth: A recurs [A[:4], the segment, A[4:]] from zero, B recurs from its state."""
    family, gen = get_family(name), torch.Generator().manual_seed(21)
    a, b, segment = (random_tokens(family, n, gen) for n in (10, 5, 30))
    T, S0 = segment_tuple(family, operands(segment, torch.float64), spans([0], [30]), (False,), [None])
    pool = torch.randn(2, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    b_state = pool[1].double().clone()
    state_spans = lambda slots, has, lens: StateSpans(torch.tensor(slots), torch.tensor(has), cu_of(lens), 0,  # noqa: E731
                                                tuple(lens))
    o = assembled_recurrence(
        operands(cat(a, b)), pool, family=family, scale=SCALE, walk=state_spans([0], [False], [6]),
        walk_rows=torch.arange(6), walks_every_row=False,
        pieces=CachedPieces.build([[(4, 0, 0)]]), t_src=T.flatten().float(), s0_src=S0.flatten().float(),
        saves=StateCheckpoints(torch.tensor([-1]), torch.tensor([0])),
        rest=state_spans([1, 0], [True, True], [5, 4]), rest_rows=torch.tensor([10, 11, 12, 13, 14, 6, 7, 8, 9]),
        chunked=lambda x, p, s: family.recur_spans(x, p, s, scale=SCALE))
    zero = torch.zeros(VALUE_HEADS, KEY_DIM, VALUE_DIM, dtype=torch.float64)
    o_a, end_a = family.recur(zero, *(cat(span(a, 0, 4), segment, span(a, 4, 10))[n] for n in NAMES), scale=SCALE)
    o_b, end_b = family.recur(b_state, *(b[n] for n in NAMES), scale=SCALE)
    truth = torch.cat([o_a[:4], o_a[34:], o_b])
    assert rel_err(o.double(), truth) <= 1e-5
    assert rel_err(pool[0].double(), end_a) <= 1e-5 and rel_err(pool[1].double(), end_b) <= 1e-5


@pytest.mark.parametrize("name", ["scalar", "gdn"])
def test_segment_tuple_marks_identity_and_reads_each_span_at_its_rows(name: str) -> None:
    family, gen = get_family(name), torch.Generator().manual_seed(22)
    tokens = operands(random_tokens(family, 14, gen))
    T, S0 = segment_tuple(family, tokens, spans([1, 8], [4, 6]), (True, False), [None, None])
    beta = None if tokens.beta is None else tokens.beta[8:14]
    alone = family.extract_tuple(tokens.k[8:14], tokens.v[8:14], tokens.g[8:14], beta, cu_of([6]), (6,))
    assert torch.equal(T[0], family.identity_T(VALUE_HEADS, KEY_DIM, T.dtype))
    assert rel_err(T[1], alone[0][0]) <= 1e-6 and rel_err(S0[1], alone[1][0]) <= 1e-6


@pytest.mark.parametrize("name", ["scalar", "diagonal", "gdn"])
def test_a_tuple_composed_across_chunks_equals_the_one_span_tuple(name: str) -> None:
    """A 30-token interior captured as 11 + 19 rows (the second chunk after the first's tuple) gives
    the tuple of all 30 at once: T = T2.T1, S0 = T2.S0_1 + S0_2."""
    family, gen = get_family(name), torch.Generator().manual_seed(23)
    x = operands(random_tokens(family, 30, gen), torch.float64)
    whole_T, whole_S0 = segment_tuple(family, x, spans([0], [30]), (False,), [None])
    first_T, first_S0 = segment_tuple(family, x, spans([0], [11]), (False,), [None])
    T, S0 = segment_tuple(family, x, spans([11], [19]), (False,), [(first_T[0], first_S0[0])])
    assert rel_err(T, whole_T) <= 1e-12 and rel_err(S0, whole_S0) <= 1e-12
