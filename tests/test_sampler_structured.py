"""Constrained decoding below the server: the sampler's masked rows, the engine's masks against
llguidance's own (prefetched, filled when a step starts, and both in one batch), and what an
unconstrained batch is spared. The mask kernel itself: test_kernels_token_mask.py."""
from __future__ import annotations

import json

import llguidance
import pytest
import torch

from hypic.config import EngineConfig
from hypic.engine import structured
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.sampler import Sampler, SamplingRow, TokenMask
from hypic.errors import InvalidRequestError
from hypic.sampling_params import SamplingParams
from hypic.structured_outputs import StructuredOutputs
from test_kernels_token_mask import bit_by_bit


def test_sampled_tokens_are_allowed_and_logprobs_are_of_the_constrained_distribution() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    words = torch.zeros(4, 2, dtype=torch.int32)
    words[:, 1] = 0b1011  # tokens 32, 33 and 35 only
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=1, seed=i)) for i, t in enumerate((0.0, 1.0, 1.0, 5.0))]
    result = Sampler(64, str).sample(logits.clone(), rows, TokenMask([(0, 0), (1, 0), (2, 0), (3, 0)], words[:1]))
    assert set(result.token_ids) <= {32, 33, 35}
    expected = torch.log_softmax(bit_by_bit(logits, range(4), range(4), words), dim=-1)
    for row, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
        assert logprob.logprob == pytest.approx(float(expected[row, token]), abs=1e-5)


def test_an_uncompilable_constraint_is_refused_when_built() -> None:
    with pytest.raises(InvalidRequestError, match="does not compile"):
        StructuredOutputs("json", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(InvalidRequestError, match="does not compile"):
        StructuredOutputs("regex", "(unclosed")


def test_only_the_masked_rows_change() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    words = torch.tensor([[0b100, 0]], dtype=torch.int32)  # token 2 only
    result = Sampler(40, str).sample(logits.clone(), [SamplingRow(SamplingParams(temperature=0.0))] * 3,
                                     TokenMask([(1, 0)], words))
    assert result.token_ids[1] == 2
    assert result.token_ids[0::2] == logits[0::2].argmax(dim=-1).tolist()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request) -> LLMEngine:
    return LLMEngine(EngineConfig(device=request.param, max_model_len=256, cpu_cache_bytes=32 << 20,
                                  segment_host_bytes=0, gpu_memory_utilization=0.2))


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


def _lltokenizer(engine: LLMEngine) -> llguidance.LLTokenizer:
    """llguidance's own view of the engine's vocabulary, for fresh matchers that replay a reply."""
    return llguidance.LLTokenizer((engine.model_dir / "tokenizer.json").read_text(),
                                  n_vocab=engine.tokenizer.vocab_size, eos_token=sorted(engine.eos_ids))


def test_engine_tokens_are_those_llguidance_allows(engine) -> None:
    """Replaying each reply through a fresh llguidance matcher accepts every token and ends accepting."""
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer", "maximum": 99,
                                                                               "minimum": 0}},
              "required": ["k", "n"], "additionalProperties": False}
    constraint = StructuredOutputs("json", json.dumps(schema))
    params = [SamplingParams(max_tokens=60, seed=s, structured=constraint) for s in range(3)]
    params.append(SamplingParams(max_tokens=5, ignore_eos=True, seed=9))  # an unconstrained neighbour
    tokens = _run(engine, params)
    tokenizer = _lltokenizer(engine)
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


def _collect(outputs, tokens: dict, reasons: dict) -> None:
    for output in outputs:
        for delta in output.deltas:
            tokens.setdefault((output.request_id, delta.index), []).extend(delta.token_ids)
            if delta.finish_reason is not None:
                reasons[(output.request_id, delta.index)] = delta.finish_reason


def test_prefetched_and_step_filled_masks_both_hold(engine) -> None:
    """Two replies are mid-grammar (their masks prefetched after each token) when a third request with
    n=2 joins (filled when its step starts, in the same batch; the bitmask of two rows grows under the
    prefetch): every reply is one a fresh llguidance matcher accepts, and each ending with `stop` is complete."""
    engine = LLMEngine(EngineConfig(device=engine.device.type, max_model_len=256, cpu_cache_bytes=32 << 20,
                                    segment_host_bytes=0, gpu_memory_utilization=0.2))  # a bitmask no test has grown
    constraint = StructuredOutputs("json", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 6}))
    tokens, reasons = {}, {}
    for name in ("a", "b"):
        engine.add_request(_prompt(engine), SamplingParams(max_tokens=40, seed=1, structured=constraint), request_id=name)
    for _ in range(4):
        _collect(engine.step(), tokens, reasons)
    engine.add_request(_prompt(engine), SamplingParams(max_tokens=40, n=2, seed=2, structured=constraint), request_id="c")
    while engine.has_work():
        _collect(engine.step(), tokens, reasons)
    tokenizer = _lltokenizer(engine)
    assert set(tokens) == {("a", 0), ("b", 0), ("c", 0), ("c", 1)}
    for key, ids in tokens.items():
        matcher = llguidance.LLMatcher(tokenizer, constraint.grammar())
        assert matcher.consume_tokens(ids), (key, matcher.get_error())
        if reasons[key] == "stop":
            assert matcher.is_accepting(), key
            json.loads(engine.tokenizer.decode(ids))


def test_the_bitmask_is_one_buffer_reused_every_step(engine, monkeypatch) -> None:
    constraint = StructuredOutputs("regex", "[a-z]{30}")
    buffers, sample = set(), engine.sampler.sample
    def spy(logits, rows, token_mask=None):
        if token_mask is not None:
            buffers.add(token_mask.words.untyped_storage().data_ptr())
        return sample(logits, rows, token_mask)
    monkeypatch.setattr(engine.sampler, "sample", spy)
    _run(engine, [SamplingParams(max_tokens=12, seed=s, structured=constraint) for s in range(2)])
    assert len(buffers) == 1


def test_a_grammar_compiles_a_matcher_per_busy_mask_thread(engine, monkeypatch) -> None:
    """Copies of one llguidance matcher share its lexer behind a lock, so their masks are computed one at
    a time. With three mask threads: requests one at a time copy one compiled matcher; five at once copy
    three; every reply holds to the grammar."""
    monkeypatch.setattr(structured, "MASK_THREADS", 3)
    compiled, compile_one = [], engine.structured._new_matcher
    monkeypatch.setattr(engine.structured, "_new_matcher",
                        lambda grammar: compiled.append(grammar) or compile_one(grammar))
    constraint = StructuredOutputs("regex", "[a-c]{3}x[0-9]{2}")  # a grammar no other test compiled
    replies = [_run(engine, [SamplingParams(max_tokens=12, seed=s, structured=constraint)])["r0"] for s in (7, 8)]
    assert compiled == [constraint.grammar()]
    tokens = _run(engine, [SamplingParams(max_tokens=12, seed=s, structured=constraint) for s in range(5)])
    assert compiled == [constraint.grammar()] * 3
    tokenizer = _lltokenizer(engine)
    for ids in [*replies, *tokens.values()]:
        matcher = llguidance.LLMatcher(tokenizer, constraint.grammar())
        assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()


def test_a_reused_request_id_never_gets_the_aborted_requests_prefetched_mask(engine) -> None:
    """Two requests under [a-z] have their next masks prefetched; the first is aborted and a request under
    its id with the disjoint grammar [0-9] joins the second: each reply holds to its own grammar (the new
    one takes neither the aborted one's prefetched row nor its neighbour's)."""
    letters, digits = StructuredOutputs("regex", "[a-z]{30}"), StructuredOutputs("regex", "[0-9]{30}")
    for name, seed in (("r0", 3), ("kept", 5)):
        engine.add_request(_prompt(engine), SamplingParams(max_tokens=9, seed=seed, structured=letters), request_id=name)
    tokens: dict = {}
    for _ in range(3):
        _collect(engine.step(), tokens, {})
    engine.abort("r0")
    tokens = {("kept", 0): tokens[("kept", 0)]}
    engine.add_request(_prompt(engine), SamplingParams(max_tokens=6, seed=4, structured=digits), request_id="r0")
    while engine.has_work():
        _collect(engine.step(), tokens, {})
    tokenizer = _lltokenizer(engine)
    for key, grammar, length in ((("r0", 0), digits, 6), (("kept", 0), letters, 9)):
        matcher = llguidance.LLMatcher(tokenizer, grammar.grammar())
        ids = tokens[key]
        assert len(ids) == length and matcher.consume_tokens(ids), (key, engine.tokenizer.decode(ids), matcher.get_error())
