"""Sampler: empirical frequencies match the analytically filtered distribution; seeds are reproducible."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hypic.engine.sampler import Sampler, SamplingRow, make_generator
from hypic.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.4, 0.0, -0.3, -1.0, -2.0, -4.0, 0.9, 1.7])
CONFIGS = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.4, top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(min_p=0.3),
    SamplingParams(temperature=0.8, min_p=0.05, top_k=6, top_p=0.85),
    SamplingParams(temperature=2.5, top_p=0.6),  # filters see the tempered distribution
    SamplingParams(temperature=0.4, min_p=0.1),
    SamplingParams(temperature=3.0, top_k=8, top_p=0.5),  # top_p renormalises after top_k
]


def _reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """float64: temperature, then min_p, top_k, top_p, each renormalising what the previous left."""
    probs = _softmax(logits / p.temperature)
    probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    if p.top_k > 0:
        kth = np.sort(np.where(probs > 0, logits, -np.inf))[::-1][p.top_k - 1]
        probs = np.where(logits >= kth, probs, 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]  # mass of the more likely tokens
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[before < p.top_p]] = True  # the fewest most likely tokens holding at least top_p
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _assert_matches(tokens: list[int], expected: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(expected))
    assert counts[expected == 0].sum() == 0, "sampled a token the filters remove"
    support = expected > 0
    e = expected[support] * len(tokens)
    chi2 = float((((counts[support] - e) ** 2) / e).sum())
    df = max(int(support.sum()) - 1, 1)
    assert chi2 < df + 6 * math.sqrt(2 * df) + 6, (chi2, df, counts, e)  # ~1e-6 false alarm; fixed seeds anyway


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_unseeded_rows_follow_the_filtered_distribution(device: str, params: SamplingParams) -> None:
    n = 20000
    logits = torch.tensor(LOGITS, dtype=torch.float32, device=device).expand(n, -1)
    tokens = Sampler(len(LOGITS), str, seed=1).sample(logits, [SamplingRow(params)] * n).token_ids
    _assert_matches(tokens, _reference(LOGITS, params))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_follow_the_filtered_distribution(device: str) -> None:
    n, params = 3000, CONFIGS[-1]
    logits = torch.tensor(LOGITS, dtype=torch.float32, device=device).expand(n, -1)
    rows = [SamplingRow(params, generator=make_generator(seed, device)) for seed in range(n)]
    _assert_matches(Sampler(len(LOGITS), str).sample(logits, rows).token_ids, _reference(LOGITS, params))


def _run(device: str, batch: list[tuple[SamplingParams, int | None]], steps: int,
         logits: torch.Tensor) -> list[list[int]]:
    """Tokens of every row over `steps` calls, each seeded row with a fresh generator of its seed."""
    rows = [SamplingRow(p, generator=None if s is None else make_generator(s, device)) for p, s in batch]
    sampler = Sampler(logits.shape[1], str, seed=7)
    return [sampler.sample(logits, rows).token_ids for _ in range(steps)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_seed_gives_the_same_tokens_whatever_the_batch(device: str) -> None:
    vocab = 500
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)).to(device) * 2
    others = [(SamplingParams(top_k=5), None), (SamplingParams(temperature=0.0), None),
              (SamplingParams(min_p=0.1, seed=99), 99)]
    alone = [t[0] for t in _run(device, [(target, 1234)], 12, row_logits[None])]
    assert len(set(alone)) > 3  # it really samples
    for batch, position in (([*others, (target, 1234)], 3), ([(target, 1234), others[0]], 0),
                            ([others[1], (target, 1234)], 1)):
        noise = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(len(batch))).to(device)
        logits = noise.index_copy(0, torch.tensor([position], device=device), row_logits[None])
        assert [t[position] for t in _run(device, batch, 12, logits)] == alone
