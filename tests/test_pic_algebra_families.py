"""PIC algebra per family, in float64: composed tuples == the sequential recurrence (DESIGN §2, §8)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from hypic.kernels.linear_families import FAMILIES, LinearFamily, expand_heads, get_family
from hypic.kernels.scatter_kv import apply_rope, rope_inv_freq
from hypic.kernels.varlen import Operands, StateSpans

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 8, 6


def random_tokens(family: LinearFamily, length: int, gen: torch.Generator, dtype: torch.dtype = torch.float64,
                  heads: tuple[int, int] = (KEY_HEADS, VALUE_HEADS), dims: tuple[int, int] = (KEY_DIM, VALUE_DIM)
                  ) -> dict[str, torch.Tensor | None]:
    """q, k (unit norm), v, log gates mostly near 0.9 decay, beta in (0, 1) for dense families."""
    (h, hv), (kd, vd) = heads, dims
    gate_shape = (length, hv, kd) if family.gate_per_key else (length, hv)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    tokens = {"q": randn(length, h, kd), "k": F.normalize(randn(length, h, kd), dim=-1),
              "v": randn(length, hv, vd), "g": F.logsigmoid(randn(*gate_shape) + 2.0),
              "beta": torch.sigmoid(randn(length, hv)) if family.kind == "dense" else None}
    return {name: None if x is None else x.to(dtype) for name, x in tokens.items()}


def span(tokens: dict[str, torch.Tensor | None], start: int, end: int) -> dict[str, torch.Tensor | None]:
    return {name: None if x is None else x[start:end] for name, x in tokens.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32)


def sequential_end(family: LinearFamily, state: torch.Tensor, tokens: dict) -> torch.Tensor:
    return family.recur(state, tokens["q"], tokens["k"], tokens["v"], tokens["g"], tokens["beta"], scale=1.0)[1]


def extract(family: LinearFamily, tokens: dict, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return family.extract_tuple(tokens["k"], tokens["v"], tokens["g"], tokens["beta"], cu_of(lens), tuple(lens))


FAMILY_NAMES = sorted(FAMILIES)


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("num_segments", [2, 4])
def test_composed_state_equals_sequential_recurrence(name: str, num_segments: int) -> None:
    family, gen = get_family(name), torch.Generator().manual_seed(num_segments)
    lens = torch.randint(3, 10, (num_segments,), generator=gen).tolist()
    tokens = random_tokens(family, sum(lens), gen)
    prefix = torch.randn(VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen, dtype=torch.float64)
    truth = sequential_end(family, prefix, tokens)
    T, S0 = extract(family, tokens, lens)
    state = prefix
    for i in range(num_segments):
        state = family.compose(T[i], S0[i], state)
    assert rel_err(state, truth) <= 1e-10
    assert rel_err(prefix + S0.sum(0), truth) > 0.05  # naive addition is structurally wrong


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_identity_trick_T_equals_explicit_product(name: str) -> None:
    family, gen = get_family(name), torch.Generator().manual_seed(1)
    lens = [5, 8]
    tokens = random_tokens(family, sum(lens), gen)
    T, _ = extract(family, tokens, lens)
    k = expand_heads(tokens["k"], VALUE_HEADS)
    for i, (start, end) in enumerate(itertools.pairwise(cu_of(lens).tolist())):
        product = family.identity_T(VALUE_HEADS, KEY_DIM, torch.float64)
        for t in range(start, end):
            beta = None if tokens["beta"] is None else tokens["beta"][t]
            product = family.combine_T(family.token_T(k[t], tokens["g"][t], beta), product)
        explicit = family.as_matrix(product, KEY_DIM)
        assert rel_err(family.as_matrix(T[i], KEY_DIM), explicit) <= 1e-12
        assert rel_err(explicit, torch.eye(KEY_DIM, dtype=torch.float64).expand_as(explicit)) > 0.05


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_tuple_of_concatenation_is_composition_of_tuples(name: str) -> None:
    family, gen = get_family(name), torch.Generator().manual_seed(2)
    tokens = random_tokens(family, 11, gen)
    T, S0 = extract(family, tokens, [4, 7])
    T_all, S0_all = extract(family, tokens, [11])
    assert rel_err(family.combine_T(T[1], T[0]), T_all[0]) <= 1e-12
    assert rel_err(family.compose(T[1], S0[1], S0[0]), S0_all[0]) <= 1e-10


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_recur_outputs_match_state_readout(name: str) -> None:
    """o_t = S_t^T (scale q_t), with value head hv reading key head hv // (HV // H)."""
    family, gen = get_family(name), torch.Generator().manual_seed(3)
    tokens = random_tokens(family, 6, gen)
    state = torch.zeros(VALUE_HEADS, KEY_DIM, VALUE_DIM, dtype=torch.float64)
    o, _ = family.recur(state, tokens["q"], tokens["k"], tokens["v"], tokens["g"], tokens["beta"], scale=0.5)
    end = sequential_end(family, state, span(tokens, 0, 4))
    for hv in range(VALUE_HEADS):
        expected = end[hv].T @ (0.5 * tokens["q"][3, hv // (VALUE_HEADS // KEY_HEADS)])
        assert torch.allclose(o[3, hv], expected, rtol=1e-12, atol=1e-12)


def test_state_rope_rerotation_equals_recomputing_at_shifted_positions() -> None:
    """Scalar family with RoPE on k inside the layer (Ring-linear): S_C|b = R(b - a) S_C|a (eq. 7)."""
    family, gen = get_family("scalar"), torch.Generator().manual_seed(4)
    tokens = random_tokens(family, 9, gen)
    inv_freq = rope_inv_freq(KEY_DIM // 2, 10000.0).double()  # partial: rotates half of K
    zero = torch.zeros(VALUE_HEADS, KEY_DIM, VALUE_DIM, dtype=torch.float64)

    def end_state_at(start: int) -> torch.Tensor:
        positions = torch.arange(start, start + 9)[:, None]
        rotated = {**tokens, "k": apply_rope(tokens["k"], positions, inv_freq)}
        return sequential_end(family, zero, rotated)

    moved = family.rotate_state(end_state_at(3), 1000 - 3, inv_freq)
    assert rel_err(moved, end_state_at(1000)) <= 1e-10
    assert rel_err(end_state_at(3), end_state_at(1000)) > 0.05


def test_gdn_kernel_extraction_matches_float64_oracle() -> None:
    """float32 tuples are the ordered products of the chunk factors (`gdn_span_tuples`, torch on CPU)."""
    family, gen = get_family("gdn"), torch.Generator().manual_seed(5)
    lens = [70, 9]  # one span crosses a chunk boundary of the reference
    tokens = random_tokens(family, sum(lens), gen)
    T64, S064 = extract(family, tokens, lens)
    T32, S032 = extract(family, random_tokens_as(tokens, torch.float32), lens)
    assert T32.dtype == torch.float32
    assert rel_err(T32.double(), T64) <= 1e-5 and rel_err(S032.double(), S064) <= 1e-5


def random_tokens_as(tokens: dict, dtype: torch.dtype) -> dict:
    return {name: None if x is None else x.to(dtype) for name, x in tokens.items()}


def test_t_storage_shapes_and_bytes() -> None:
    shapes = {name: get_family(name).t_shape(128) for name in FAMILY_NAMES}
    assert shapes == {"scalar": (), "diagonal": (128,), "gdn": (128, 128), "kda": (128, 128)}
    assert get_family("gdn").t_bytes(128, torch.bfloat16) == 32768  # paper Table 3: 32 KB per head
    assert get_family("diagonal").t_bytes(128, torch.float16) == 256


@pytest.mark.gpu
def test_gdn_extraction_on_gpu_matches_float64_oracle() -> None:
    """The chunk-factor product's Triton kernels (`gdn_span_tuples`), bf16 inputs."""
    family, gen = get_family("gdn"), torch.Generator().manual_seed(6)
    lens = [100, 30]  # the first crosses a chunk boundary
    tokens = random_tokens(family, sum(lens), gen, heads=(2, 4), dims=(128, 128))
    T64, S064 = extract(family, tokens, lens)
    cuda = {name: None if x is None else x.to("cuda", torch.bfloat16 if name in "qkv" else torch.float32)
            for name, x in tokens.items()}
    T, S0 = family.extract_tuple(cuda["k"], cuda["v"], cuda["g"], cuda["beta"], cu_of(lens).cuda(), tuple(lens))
    assert rel_err(T.double().cpu(), T64) <= 2e-2 and rel_err(S0.double().cpu(), S064) <= 2e-2


# -- the scalar family's chunked paths against its float64 token recurrence --------------------------

SCALAR_LENS = [150, 0, 7, 64, 1]  # across chunk boundaries (64), empty, exactly one chunk, one token


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_scalar_run_chunked_equals_token_recurrence(dtype: torch.dtype, bound: float) -> None:
    family, gen = get_family("scalar"), torch.Generator().manual_seed(11)
    tokens = random_tokens(family, 150, gen)
    state = torch.randn(VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen, dtype=torch.float64)
    o64, end64 = family.recur(state, *(tokens[x] for x in ("q", "k", "v", "g", "beta")), scale=0.3)
    low = {name: None if x is None else x.to(dtype) for name, x in tokens.items()}
    o, end = family.run(state.to(dtype), *(low[x] for x in ("q", "k", "v", "g", "beta")), scale=0.3)
    assert rel_err(o.double(), o64) <= bound and rel_err(end.double(), end64) <= bound


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_scalar_final_states_and_tuples_chunked_equal_token_recurrence(dtype: torch.dtype, bound: float) -> None:
    family, gen = get_family("scalar"), torch.Generator().manual_seed(12)
    tokens = random_tokens(family, sum(SCALAR_LENS), gen)
    initial = torch.randn(len(SCALAR_LENS), VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen, dtype=torch.float64)
    bounds = list(itertools.pairwise(itertools.accumulate(SCALAR_LENS, initial=0)))
    truth = torch.stack([sequential_end(family, initial[b], span(tokens, *se)) for b, se in enumerate(bounds)])
    zero_truth = torch.stack([sequential_end(family, torch.zeros_like(initial[0]), span(tokens, *se))
                              for se in bounds])
    low = {name: None if x is None else x.to(dtype) for name, x in tokens.items()}
    ends = family.final_states(low["k"], low["v"], low["g"], None, initial.to(dtype), cu_of(SCALAR_LENS),
                               tuple(SCALAR_LENS))
    T, S0 = extract(family, low, SCALAR_LENS)
    assert rel_err(ends.double(), truth) <= bound and rel_err(S0.double(), zero_truth) <= bound
    gate_sums = torch.stack([tokens["g"][s:e].sum(0) for s, e in bounds])
    assert T.shape == (len(SCALAR_LENS), VALUE_HEADS) and rel_err(T.double(), gate_sums) <= bound


def test_scalar_recur_spans_reads_and_writes_the_pool() -> None:
    """The varlen path a Mamba2 layer runs: spans from their slots (or zeros), end states written back."""
    family, gen = get_family("scalar"), torch.Generator().manual_seed(13)
    lens, slots, has_state = [70, 5, 1], [2, 0, 3], [True, False, True]
    tokens = random_tokens(family, sum(lens), gen, dtype=torch.float32)
    pool = torch.randn(4, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    before = pool.double().clone()
    spans = StateSpans(torch.tensor(slots), torch.tensor(has_state), cu_of(lens), 0, tuple(lens))
    x = Operands(*(tokens[n] for n in ("q", "k", "v", "g", "beta")))
    o = family.recur_spans(x, pool, spans, scale=0.5)
    for b, (start, end) in enumerate(itertools.pairwise(itertools.accumulate(lens, initial=0))):
        init = before[slots[b]] if has_state[b] else torch.zeros_like(before[0])
        part = {n: None if t is None else t.double() for n, t in span(tokens, start, end).items()}
        o64, end64 = family.recur(init, *(part[n] for n in ("q", "k", "v", "g", "beta")), scale=0.5)
        assert rel_err(o[start:end].double(), o64) <= 1e-5 and rel_err(pool[slots[b]].double(), end64) <= 1e-5
    assert torch.equal(pool[1].double(), before[1])  # a slot no span names is untouched
