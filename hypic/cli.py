"""The `hypic` command: `hypic serve [options]` (same options as `python -m hypic.serve`) and `hypic demo`."""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

from hypic import AsyncEngine, EngineConfig, SamplingParams, __version__
from hypic.data import eval_prompts
from hypic.data.tasks import is_correct
from hypic.serve.args import add_serve_arguments
from hypic.serve.server import DESCRIPTION, run_from_args

DEMO_DESCRIPTION = """Ask the bundled model one question over four notes, twice: cold (nothing cached), then
warm with the notes in another order, where each note's cached tuple is reused at its new position.
Prints the answers, TTFT and cached_tokens of both; exits 1 if either answer is wrong."""


@dataclass(frozen=True)
class DemoRun:
    label: str
    text: str
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypic", description="hypic: serving hybrid-attention LLMs.")
    parser.add_argument("--version", action="version", version=f"hypic {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server", description=DESCRIPTION)
    add_serve_arguments(serve)
    demo = commands.add_parser("demo", help="one question to the bundled model, cold then warm",
                               description=DEMO_DESCRIPTION)
    demo.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return asyncio.run(run_demo(args.device))
    return run_from_args(serve, args)


async def run_demo(device: str) -> int:
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
