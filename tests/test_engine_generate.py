"""End-to-end generation on CPU against transformers (the independent oracle)."""
from __future__ import annotations

import pytest
from engine_util import cpu_config, greedy, hf_greedy, run_engine

from hypic.engine.text.tokenizer import Tokenizer

STEPS = 6


def prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> int:
    return Tokenizer.from_dir(tiny_model_dir).vocab_size


def test_greedy_tokens_and_logprobs_match_transformers(tiny_model_dir, vocab):
    [prompt] = prompts(vocab, [23])
    [out] = run_engine(cpu_config(tiny_model_dir), [(prompt, greedy(STEPS, logprobs=0))])
    expected, expected_logprobs = hf_greedy(tiny_model_dir, prompt, STEPS, vocab)
    assert out.tokens == expected
    got = [lp.logprob for lp in out.logprobs[0]]
    assert got == pytest.approx(expected_logprobs, rel=1e-4, abs=1e-4)
    assert out.finish_reason[0] == "length"
    assert out.metrics.prompt_tokens == 23


def test_batch_of_eight_equals_each_alone(tiny_model_dir, vocab):
    batch = prompts(vocab, [3, 9, 17, 30, 5, 12, 41, 8])
    together = run_engine(cpu_config(tiny_model_dir), [(p, greedy(STEPS)) for p in batch])
    for prompt, out in zip(batch, together):
        assert out.tokens == hf_greedy(tiny_model_dir, prompt, STEPS, vocab)[0]


@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_equals_unchunked(tiny_model_dir, vocab, budget):
    batch = prompts(vocab, [37, 22])
    chunked = run_engine(cpu_config(tiny_model_dir, max_num_batched_tokens=budget),
                         [(p, greedy(STEPS)) for p in batch])
    whole = run_engine(cpu_config(tiny_model_dir, max_num_batched_tokens=512),
                       [(p, greedy(STEPS)) for p in batch])
    assert [o.tokens for o in chunked] == [o.tokens for o in whole]
    assert whole[0].tokens == hf_greedy(tiny_model_dir, batch[0], STEPS, vocab)[0]
