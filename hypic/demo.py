"""`hypic demo`: one question to the bundled model, cold and then warm, showing the segment cache at work."""
from __future__ import annotations

from dataclasses import dataclass

from hypic import EngineConfig, SamplingParams
from hypic.data import eval_prompts
from hypic.data.tasks import is_correct

DESCRIPTION = """Ask the bundled model one question over four notes, twice: cold (nothing cached), then
warm with the notes in another order, where each note's cached tuple is reused at its new position.
Prints the answers, TTFT and cached_tokens of both; exits 1 if either answer is wrong."""


@dataclass(frozen=True)
class DemoRun:
    label: str
    text: str
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int


async def run_demo(device: str) -> int:
    from hypic import AsyncEngine  # torch and the model code load only when the demo runs, not for `hypic --help`
    prompt = eval_prompts(1)[0]  # a lookup question, in the format the bundled model was trained on
    prefix, *notes, query = prompt.segments
    print(f"question: {prompt.qas[0].question}  (expected answer: {prompt.answer})")
    async with AsyncEngine(EngineConfig(device=device)) as engine:
        runs = [await _ask(engine, "cold", [prefix, *notes, query]),
                await _ask(engine, "warm, notes reversed", [prefix, *reversed(notes), query])]
    for run in runs:
        print(f"{run.label:>22}: TTFT {run.ttft_ms:6.0f} ms, cached_tokens {run.cached_tokens:4d} of "
              f"{run.prompt_tokens}: {run.text!r}")
    return 0 if all(is_correct(run.text, prompt.answer) for run in runs) else 1


async def _ask(engine: AsyncEngine, label: str, segments: list[str]) -> DemoRun:
    text, metrics = "", None
    async for out in engine.generate(segments, SamplingParams(temperature=0.0, max_tokens=48)):
        text, metrics = text + "".join(d.text for d in out.deltas), out.metrics
    return DemoRun(label, text, metrics.ttft * 1000, metrics.prompt_tokens, metrics.cached_tokens)
