"""Prompt logprobs (echo) against transformers' full forward: log_softmax of its logits at every
prompt position, over the tokenizer's vocabulary."""
from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from engine_util import GPU_SHARE, collect, cpu_config, greedy, hf_greedy, hf_model, run_engine
from models_util import hf_torch_logits

from hypic import AsyncEngine

from hypic.engine.prompt_logprobs import PromptScoring, score_prompt_rows
from hypic.engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> int:
    return Tokenizer.from_dir(tiny_model_dir).vocab_size


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def hf_prompt_logprobs(model_dir, prompt: tuple[int, ...], vocab: int) -> torch.Tensor:
    """[L - 1, vocab]: row p is the distribution of prompt token p + 1, by transformers on the CPU."""
    with torch.no_grad():
        logits = hf_model(model_dir)(input_ids=torch.tensor([prompt])).logits[0, :-1, :vocab].double()
    return torch.log_softmax(logits, -1)


def check_against_hf(model_dir, prompt: list[int], vocab: int, got: tuple, k: int, tolerance: float = 1e-4) -> None:
    check_scores(hf_prompt_logprobs(model_dir, tuple(prompt), vocab), prompt, got, k, tolerance)


def check_scores(reference: torch.Tensor, prompt: list[int], got: tuple, k: int, tolerance: float) -> None:
    """`got` (the engine's prompt logprobs, top k) against log-probabilities `reference` [L - 1, vocab]."""
    assert (got[0].token_id, got[0].logprob, got[0].top) == (prompt[0], None, ()) and len(got) == len(prompt)
    for position, item in enumerate(got[1:]):
        row = reference[position]
        assert item.token_id == prompt[position + 1]
        assert item.logprob == pytest.approx(float(row[item.token_id]), abs=tolerance)
        target = row[item.token_id]  # ranks may differ where another token is within the tolerance
        assert 1 + int((row > target + tolerance).sum()) <= item.rank <= 1 + int((row > target - tolerance).sum())
        assert len(item.top) == k
        assert [lp for _, _, lp in item.top] == pytest.approx(row.topk(k).values.tolist(), abs=tolerance)
        assert all(float(row[token]) == pytest.approx(lp, abs=tolerance) for token, _, lp in item.top)


def test_prompt_logprobs_over_several_chunks_match_transformers(tiny_model_dir, vocab):
    """A 45-token prompt prefilled 16 tokens a step, beside a plain request; then it generates."""
    prompt, other = random_prompt(vocab, 45, 1), random_prompt(vocab, 20, 2)
    config = cpu_config(tiny_model_dir, max_num_batched_tokens=16)
    scored, plain = run_engine(config, [(prompt, greedy(3, prompt_logprobs=3)), (other, greedy(3))])
    check_against_hf(tiny_model_dir, prompt, vocab, scored.prompt_logprobs, 3)
    assert scored.outputs_with_prompt_logprobs == 1 and plain.prompt_logprobs is None
    assert scored.tokens == hf_greedy(tiny_model_dir, prompt, 3, vocab)[0]
    assert plain.tokens == hf_greedy(tiny_model_dir, other, 3, vocab)[0]


def test_scoring_recomputes_a_cached_prompt_and_scores_once_for_n(tiny_model_dir, vocab):
    """The second request would hit the first one's prefix checkpoint; prompt logprobs skip it."""
    prompt = random_prompt(vocab, 30, 3)

    async def one_after_another():
        async with AsyncEngine(cpu_config(tiny_model_dir)) as engine:
            return [await collect(engine, prompt, params) for params in
                    (greedy(2), greedy(2, n=2, prompt_logprobs=0), greedy(2))]

    first, scored, third = asyncio.run(one_after_another())
    check_against_hf(tiny_model_dir, prompt, vocab, scored.prompt_logprobs, 0)
    assert scored.metrics.cached_tokens == 0 and scored.outputs_with_prompt_logprobs == 1
    assert third.metrics.cached_tokens > 0  # what the scored request passed up
    assert scored.token_ids == {0: first.tokens, 1: first.tokens}


def test_max_tokens_zero_returns_only_the_prompt_scores(tiny_model_dir, vocab):
    prompt = random_prompt(vocab, 12, 4)
    [out] = run_engine(cpu_config(tiny_model_dir), [(prompt, greedy(0, prompt_logprobs=1))])
    check_against_hf(tiny_model_dir, prompt, vocab, out.prompt_logprobs, 1)
    assert out.finish_reason[0] == "length" and not out.tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chunked_projection_equals_one_full_log_softmax(device):
    """Rows projected 7 at a time, logits past the tokenizer's vocabulary excluded."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(30, 8, generator=g), torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 45, (30,), generator=g)
    on_device = weight.to(device)
    scores = score_prompt_rows(hidden.to(device), PromptScoring(tuple(range(30)), tuple(targets.tolist()), 4),
                               lambda h: h @ on_device.T, 45, rows_per_chunk=7)
    reference = torch.log_softmax((hidden.double() @ weight.double().T)[:, :45], -1)
    assert scores.logprobs == pytest.approx(reference.gather(1, targets[:, None])[:, 0].tolist(), abs=1e-5)
    assert scores.top_ids == reference.topk(4).indices.tolist()
    chosen = reference.gather(1, targets[:, None])
    assert scores.ranks == ((reference > chosen + 1e-9).sum(-1) + 1).tolist()
    for row, expected in zip(scores.top_logprobs, reference.topk(4).values.tolist(), strict=True):
        assert row == pytest.approx(expected, abs=1e-5)


@pytest.mark.gpu
def test_prompt_logprobs_on_the_gpu_match_transformers(tiny_model_dir, vocab):
    """A 400-token prompt scored in one CUDA step beside a plain request (no graph may take it)."""
    prompt, other = random_prompt(vocab, 400, 5), random_prompt(vocab, 30, 6)
    config = cpu_config(tiny_model_dir, device="cuda", dtype="float32", block_size=16, gpu_memory_utilization=GPU_SHARE,
                        max_num_batched_tokens=512)
    scored, plain = run_engine(config, [(prompt, greedy(4, prompt_logprobs=2)), (other, greedy(4))])
    logits = hf_torch_logits(tiny_model_dir, [prompt])[0][:-1, :vocab].double()
    reference = torch.log_softmax(logits, -1)  # float32 on the CPU, FLA hidden: no TF32 dots on either side
    error = max(abs(item.logprob - float(row[item.token_id]))
                for item, row in zip(scored.prompt_logprobs[1:], reference, strict=True))
    print(f"largest prompt-logprob error against transformers: {error:.2e}")
    check_scores(reference, prompt, scored.prompt_logprobs, 2, tolerance=2e-3)  # a misplaced position or
    # token would be off by whole nats
    assert plain.tokens == hf_greedy(tiny_model_dir, other, 4, vocab, device="cuda")[0]
