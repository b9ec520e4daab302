"""A request resumed from the tokens it generated elsewhere (its node died) continues exactly as the
undisturbed run: the same tokens, and text that joins what was emitted before the cut without a
character repeated or lost — penalties, seeded sampling, n > 1 and stop strings across the cut."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest
from engine_util import GPU_SHARE, cpu_config, greedy

from hypic import AsyncEngine, InvalidRequestError, SamplingParams

PROMPT = "the river archive lists rivers near copper street; "
CUT = 6  # tokens each completion had made when its node died
PENALTIES = dict(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.3)


@dataclass
class Stream:
    """Per completion: its tokens, and its text after each of its deltas (what a client had seen)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    texts: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # (tokens so far, text so far)
    reasons: dict[int, str | None] = field(default_factory=dict)

    def text(self, index: int) -> str:
        return self.texts[index][-1][1]

    def text_through(self, index: int, tokens: int) -> str:
        """The text the client had once `tokens` of this completion's tokens had arrived."""
        return [text for count, text in self.texts[index] if count <= tokens][-1]


async def run(engine: AsyncEngine, params: SamplingParams, resume=None) -> Stream:
    stream = Stream()
    async for out in engine.generate(PROMPT, params, resume=resume):
        for d in out.deltas:
            tokens = stream.tokens.setdefault(d.index, [])
            tokens.extend(d.token_ids)
            previous = stream.texts.get(d.index, [(0, "")])[-1][1]
            stream.texts.setdefault(d.index, [(0, "")]).append((len(tokens), previous + d.text))
            stream.reasons[d.index] = d.finish_reason
    return stream


def resumed(whole: Stream, indices) -> dict[int, list[int]]:
    return {i: whole.tokens[i][:CUT] for i in indices}


def assert_continues(whole: Stream, rest: Stream, indices) -> None:
    for i in indices:
        assert whole.tokens[i][:CUT] + rest.tokens[i] == whole.tokens[i], i
        assert whole.text_through(i, CUT) + rest.text(i) == whole.text(i), i
        assert rest.reasons[i] == whole.reasons[i], i


@pytest.fixture(scope="module")
def engine_loop(tiny_model_dir):
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(cpu_config(tiny_model_dir))
    loop.run_until_complete(engine.start())
    yield engine, loop
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.mark.parametrize("params", [
    greedy(24, n=2, **PENALTIES),
    SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=24, ignore_eos=True, **PENALTIES),
    SamplingParams(temperature=0.8, top_k=40, seed=3, n=3, max_tokens=20, ignore_eos=True, logprobs=2),
], ids=["greedy-penalties", "seeded", "seeded-top-k"])
def test_a_resumed_request_continues_the_undisturbed_run(engine_loop, params):
    engine, loop = engine_loop
    whole = loop.run_until_complete(run(engine, params))
    if params.n > 1 and not params.greedy:
        assert len({tuple(t) for t in whole.tokens.values()}) > 1  # each completion its own tokens
    rest = loop.run_until_complete(run(engine, params, resumed(whole, range(params.n))))
    assert_continues(whole, rest, range(params.n))


def test_a_stop_string_spanning_the_cut_and_a_finished_completion(engine_loop):
    engine, loop = engine_loop
    probe = loop.run_until_complete(run(engine, greedy(24, n=2, **PENALTIES)))
    text = probe.text(0)
    start = len(probe.text_through(0, CUT - 2))
    stop = text[start:len(probe.text_through(0, CUT + 2))]  # matched only after the cut
    assert stop and stop not in text[:start + len(stop) - 1]
    params = greedy(24, n=2, stop=(stop,), **PENALTIES)
    whole = loop.run_until_complete(run(engine, params))
    assert whole.reasons[0] == "stop" and len(whole.tokens[0]) > CUT
    rest = loop.run_until_complete(run(engine, params, resumed(whole, [0])))  # completion 1 "finished" before
    assert set(rest.tokens) == {0}
    assert_continues(whole, rest, [0])


def test_a_resume_past_max_tokens_or_n_is_refused(engine_loop):
    engine, loop = engine_loop
    for resume in ({0: list(range(10, 14))}, {2: [10]}):
        with pytest.raises(InvalidRequestError, match="resume"):
            loop.run_until_complete(run(engine, replace(greedy(4), n=2), resume))


@pytest.mark.gpu
def test_a_seeded_request_resumes_on_cuda(tiny_model_dir):
    """CUDA generators advance by offsets: the skipped draws must move them as sampling would."""
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=24, ignore_eos=True, **PENALTIES)

    async def main() -> tuple[Stream, Stream]:
        config = cpu_config(tiny_model_dir, device="cuda", dtype="float32", gpu_memory_utilization=GPU_SHARE)
        async with AsyncEngine(config) as engine:
            whole = await run(engine, params)
            return whole, await run(engine, params, resumed(whole, range(params.n)))
    whole, rest = asyncio.run(main())
    assert_continues(whole, rest, range(params.n))
