"""Admission (issue 23, items 4 and 5): requests of one group (a client's batch) are admitted in
turn with other groups', a request counts its n sequences as waiting, and abort commands are not
waiting requests."""
from __future__ import annotations

import asyncio

import pytest
from engine_util import cpu_config, greedy

from hypic import AsyncEngine, SamplingParams
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.errors import InvalidRequestError


def _prompt(seed: int) -> SegmentedPrompt:
    return SegmentedPrompt((tuple(range(10 + seed, 18 + seed)),))


def _finish_order(engine: LLMEngine) -> list[str]:
    order = []
    while engine.has_work():
        order += [output.request_id for output in engine.step() if output.finished]
    return order


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(cpu_config(tiny_model_dir, max_num_seqs=1))


def test_a_batch_does_not_hold_back_a_later_request(engine) -> None:
    """One sequence runs at a time; a batch of three arrives before a single request: first-come
    order would run the whole batch first, round-robin over groups runs the single one second."""
    for index in range(3):
        engine.add_request(_prompt(index), greedy(1), request_id=f"batch-{index}", group="batch")
    engine.add_request(_prompt(5), greedy(1), request_id="single", group="single")
    assert _finish_order(engine) == ["batch-0", "single", "batch-1", "batch-2"]


def test_a_later_request_waits_behind_the_batchs_next_turn(engine) -> None:
    """Turns count from the one being served: a newcomer never starves a batch's next prompt."""
    for index in range(3):
        engine.add_request(_prompt(index), greedy(1), request_id=f"batch-{index}", group="batch")
    engine.add_request(_prompt(5), greedy(1), request_id="first", group="first")
    order = [output.request_id for output in engine.step() if output.finished]
    engine.add_request(_prompt(6), greedy(1), request_id="later", group="later")
    assert order + _finish_order(engine) == ["batch-0", "first", "batch-1", "later", "batch-2"]


def test_ungrouped_requests_keep_their_arrival_order(engine) -> None:
    for index in range(3):
        engine.add_request(_prompt(index), greedy(1), request_id=f"alone-{index}")
    assert _finish_order(engine) == ["alone-0", "alone-1", "alone-2"]


def test_a_request_counts_its_n_sequences_until_they_run(engine) -> None:
    engine.add_request(_prompt(0), greedy(2, n=4), request_id="four")
    engine.add_request(_prompt(1), greedy(2), request_id="one")
    assert engine.waiting_sequences() == 5
    engine.step()  # "four" runs and forks its completions; "one" still waits
    assert engine.waiting_sequences() == 1
    _finish_order(engine)
    assert engine.waiting_sequences() == 0


def test_queued_aborts_are_not_waiting_requests(tiny_model_dir) -> None:
    async def main() -> None:
        async with AsyncEngine(cpu_config(tiny_model_dir, max_waiting=2)) as engine:
            for index in range(50):
                await engine.abort(f"gone-{index}")  # a refused batch's aborts, all queued at once
            outputs = [out async for out in engine.generate([5, 6, 7], greedy(1))]
            assert outputs[-1].finished
            with pytest.raises(InvalidRequestError, match="max_waiting=2"):  # never fits: no use retrying
                await anext(engine.generate([5, 6, 7], SamplingParams(n=3, max_tokens=1)))
    asyncio.run(main())
