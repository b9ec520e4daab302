"""What the engine reports for /metrics: token steps and their gaps per request, and preemptions."""
from __future__ import annotations

import time

import pytest
import torch
from engine_util import cpu_config, greedy

from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt


def _add(engine: LLMEngine, n_tokens: int, seed: int, params) -> str:
    tokens = torch.randint(3, 250, (n_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    return engine.add_request(SegmentedPrompt.build(engine.tokenizer, tokens, separator="<|segment|>"), params)


def test_each_token_step_reports_its_gap_within_the_steps_around_it(tiny_model_dir) -> None:
    engine = LLMEngine(cpu_config(tiny_model_dir, max_num_batched_tokens=8))  # a 20-token prompt: 3 chunks
    _add(engine, 20, 0, greedy(6, n=2))
    spans, seen = [], []  # (start, end) of each engine step that gave tokens; its output's metrics
    while engine.has_work():
        start = time.monotonic()
        outputs = [o for o in engine.step() if any(d.token_ids for d in o.deltas)]
        spans += [(start, time.monotonic())] * len(outputs)
        seen += [o.metrics for o in outputs]
    assert [m.token_steps for m in seen] == list(range(1, 7))  # two completions, one step each time
    assert seen[0].inter_token_latency is None and seen[0].decode_time == 0.0
    for (before, after), (start, end), m in zip(spans, spans[1:], seen[1:]):
        assert start - after <= m.inter_token_latency <= end - before
    gaps = sum(m.inter_token_latency for m in seen[1:])
    assert seen[-1].decode_time == pytest.approx(gaps) and seen[-1].generated_tokens == 12


def test_preemptions_are_counted(tiny_model_dir) -> None:
    # 38 pages of 4 tokens and 5 state slots: four 60-token sequences must preempt one another.
    engine = LLMEngine(cpu_config(tiny_model_dir, cpu_cache_bytes=150_000, segment_pool_bytes=0, max_model_len=64,
                                  max_num_seqs=4))
    for seed in range(4):
        _add(engine, 20, seed, greedy(40))
    observed = 0  # sequences running before a step and waiting after it
    while engine.has_work():
        running = {id(seq) for seq in engine.scheduler.running}
        engine.step()
        observed += sum(id(seq) in running for seq in engine.scheduler.waiting)
    assert engine.stats().preemptions >= observed > 0
    roomy = LLMEngine(cpu_config(tiny_model_dir))
    _add(roomy, 20, 0, greedy(4))
    while roomy.has_work():
        roomy.step()
    assert roomy.stats().preemptions == 0
