"""Sampler: greedy, vocabulary cut, penalties and bias against hand computations, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from hypic.engine.sampler import (Sampler, SamplingRow, apply_logit_bias, apply_penalties, make_generator,
                                  validate_for_vocab)
from hypic.errors import InvalidRequestError
from hypic.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
GREEDY = SamplingParams(temperature=0.0)


def _sampler(vocab: int) -> Sampler:
    return Sampler(vocab, lambda i: f"<{i}>", seed=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_within_the_vocabulary(device: str, dtype: torch.dtype) -> None:
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    logits[:, 50:] = 1e4  # embedding padding past the tokenizer's 50 ids must never win
    result = _sampler(50).sample(logits, [SamplingRow(GREEDY)] * 7)
    assert result.token_ids == logits[:, :50].argmax(dim=-1).tolist()
    assert result.device_token_ids.device.type == device and result.logprobs == [None] * 7


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_and_tiny_temperature_are_greedy_even_on_ties(device: str) -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).to(device)
    logits[:, 7] = logits[:, 3] = logits.max() + 1.0  # a tie at the top: argmax takes the first
    rows = [SamplingRow(SamplingParams(top_k=1, seed=i), generator=make_generator(i, device)) for i in range(3)]
    rows += [SamplingRow(SamplingParams(temperature=1e-7))] * 3
    assert _sampler(40).sample(logits, rows).token_ids == [3] * 6


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_keeps_greedy_rows_greedy(device: str) -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(2)).to(device)
    rows = [SamplingRow(GREEDY if i % 2 else SamplingParams(top_k=2)) for i in range(8)]
    result = _sampler(30).sample(logits, rows)
    top2 = logits.topk(2, dim=-1).indices.tolist()
    for i, token in enumerate(result.token_ids):
        assert token == top2[i][0] if i % 2 else token in top2[i]


def _hand_penalties(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = output.count(token)
        out.append(x - p.frequency_penalty * count - p.presence_penalty * (count > 0))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_a_hand_computation(device: str) -> None:
    logits = [[2.0, -1.0, 0.5, -0.25, 3.0, 1.0]] * 3
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(frequency_penalty=-0.4),
              SamplingParams()]
    histories = [([0, 1, 9], [1, 2, 2, 4]), ([5], [3, 3, 3]), ([0], [1])]
    rows = [SamplingRow(p, prompt, output) for p, (prompt, output) in zip(params, histories)]
    tensor = torch.tensor(logits, device=device)
    apply_penalties(tensor, rows)
    expected = [_hand_penalties(logits[i], *histories[i], params[i]) for i in range(3)]
    assert torch.allclose(tensor.cpu(), torch.tensor(expected), atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_is_added_and_can_force_a_token(device: str) -> None:
    params = SamplingParams(temperature=0.0, logit_bias={"3": 100, 5: -2.5})
    logits = torch.zeros(2, 8, device=device)
    apply_logit_bias(logits, [SamplingRow(params), SamplingRow(GREEDY)])
    assert logits[0].tolist() == [0, 0, 0, 100, 0, -2.5, 0, 0] and logits[1].abs().sum() == 0
    raw = torch.randn(1, 8, device=device)
    assert _sampler(8).sample(raw, [SamplingRow(params)]).token_ids == [3]
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        validate_for_vocab(SamplingParams(logit_bias={8: 1.0}), vocab_size=8)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1.0})


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_raw_log_softmax(device: str) -> None:
    logits = torch.randn(4, 80, generator=torch.Generator().manual_seed(3)).to(device)
    logits[:, 60:] = 50.0  # padding: excluded from the distribution too
    rows = [SamplingRow(SamplingParams(logprobs=3, temperature=0.5, top_p=0.5, presence_penalty=1.0), [], [1, 2]),
            SamplingRow(SamplingParams(logprobs=0, temperature=0.0)),
            SamplingRow(SamplingParams(temperature=0.0, logit_bias={9: 5.0})),
            SamplingRow(SamplingParams(logprobs=5, temperature=0.0, logit_bias={9: 100.0}))]
    result = _sampler(60).sample(logits, rows)
    reference = torch.log_softmax(logits[:, :60].double().cpu(), dim=-1)
    assert result.logprobs[2] is None and result.token_ids[3] == 9
    for i, n in ((0, 3), (1, 0), (3, 5)):
        lp = result.logprobs[i]
        assert lp.token_id == result.token_ids[i] and lp.token == f"<{lp.token_id}>"
        assert math.isclose(lp.logprob, reference[i, lp.token_id].item(), abs_tol=1e-5)
        values, ids = reference[i].topk(n)
        assert [t for t, _, _ in lp.top] == ids.tolist() and [text for _, text, _ in lp.top] == [f"<{t}>" for t in ids]
        assert [v for _, _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_sampling_params_validation_additions() -> None:
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-1,))
