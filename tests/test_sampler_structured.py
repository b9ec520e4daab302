"""Constrained decoding below the server: the sampler's bitmask against a bit-by-bit reference, the
engine's masks against llguidance's own, and what an unconstrained batch is spared."""
from __future__ import annotations

import json

import llguidance
import pytest
import torch

from hypic.config import EngineConfig
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.sampler import Sampler, SamplingRow, apply_token_mask
from hypic.errors import InvalidRequestError
from hypic.sampling_params import SamplingParams
from hypic.structured_outputs import StructuredOutputs


def _reference_mask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            if not (int(words[row, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


def test_token_mask_matches_a_bit_by_bit_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=generator)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=generator)
    assert torch.equal(apply_token_mask(logits, words), _reference_mask(logits, words))


def test_sampled_tokens_are_allowed_and_logprobs_are_of_the_constrained_distribution() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    words = torch.zeros(4, 2, dtype=torch.int32)
    words[:, 1] = 0b1011  # tokens 32, 33 and 35 only
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=1, seed=i)) for i, t in enumerate((0.0, 1.0, 1.0, 5.0))]
    result = Sampler(64, str).sample(logits, rows, words)
    assert set(result.token_ids) <= {32, 33, 35}
    expected = torch.log_softmax(_reference_mask(logits, words), dim=-1)
    for row, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
        assert logprob.logprob == pytest.approx(float(expected[row, token]), abs=1e-5)


def test_an_uncompilable_constraint_is_refused_when_built() -> None:
    with pytest.raises(InvalidRequestError, match="does not compile"):
        StructuredOutputs("json", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(InvalidRequestError, match="does not compile"):
        StructuredOutputs("regex", "(unclosed")


@pytest.mark.gpu
def test_token_mask_on_the_gpu_matches_the_cpu() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 5000, generator=generator)
    words = torch.randint(-(2**31), 2**31 - 1, (32, 157), dtype=torch.int32, generator=generator)
    on_gpu = apply_token_mask(logits.cuda().bfloat16(), words)
    assert torch.equal(torch.isinf(on_gpu.cpu()), torch.isinf(apply_token_mask(logits, words)))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request) -> LLMEngine:
    return LLMEngine(EngineConfig(device=request.param, max_model_len=256, cpu_cache_bytes=32 << 20, segment_host_bytes=0))


def _prompt(engine: LLMEngine) -> SegmentedPrompt:
    return SegmentedPrompt((tuple(engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")),))


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list[int]]:
    for index, p in enumerate(params):
        engine.add_request(_prompt(engine), p, request_id=f"r{index}")
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            for delta in output.deltas:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
    return tokens


def test_engine_tokens_are_those_llguidance_allows(engine) -> None:
    """Replaying each reply through a fresh llguidance matcher accepts every token and ends accepting."""
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer", "maximum": 99,
                                                                               "minimum": 0}},
              "required": ["k", "n"], "additionalProperties": False}
    constraint = StructuredOutputs("json", json.dumps(schema))
    params = [SamplingParams(max_tokens=60, seed=s, structured=constraint) for s in range(3)]
    params.append(SamplingParams(max_tokens=5, ignore_eos=True, seed=9))  # an unconstrained neighbour
    tokens = _run(engine, params)
    tokenizer = llguidance.LLTokenizer((engine.model_dir / "tokenizer.json").read_text(),
                                       n_vocab=engine.tokenizer.vocab_size, eos_token=sorted(engine.eos_ids))
    for request in ("r0", "r1", "r2"):
        matcher = llguidance.LLMatcher(tokenizer, constraint.grammar())
        assert matcher.consume_tokens(tokens[request]), matcher.get_error()
        assert matcher.is_accepting()
        json.loads(engine.tokenizer.decode(tokens[request]))
    assert len(tokens["r3"]) == 5


def test_an_unconstrained_batch_fills_no_mask(engine, monkeypatch) -> None:
    masks, fill = [], engine.structured.fill
    monkeypatch.setattr(engine.structured, "fill", lambda batch: masks.append(fill(batch)) or masks[-1])
    _run(engine, [SamplingParams(max_tokens=4, ignore_eos=True) for _ in range(3)])
    assert len(masks) >= 4 and all(mask is None for mask in masks)
