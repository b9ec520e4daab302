"""Engine-test helpers: run requests to completion and collect what came out."""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hypic import AsyncEngine, EngineConfig, SamplingParams
from hypic.outputs import RequestMetrics


@dataclass
class Finished:
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # completion index -> tokens
    text: dict[int, str] = field(default_factory=dict)
    finish_reason: dict[int, str | None] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    metrics: RequestMetrics | None = None
    prompt_logprobs: tuple | None = None
    outputs_with_prompt_logprobs: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.token_ids[0]


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, **kwargs) -> Finished:
    done = Finished()
    async for out in engine.generate(prompt, params, **kwargs):
        for d in out.deltas:
            done.token_ids.setdefault(d.index, []).extend(d.token_ids)
            done.text[d.index] = done.text.get(d.index, "") + d.text
            done.logprobs.setdefault(d.index, []).extend(d.logprobs or ())
            done.finish_reason[d.index] = d.finish_reason
        done.metrics = out.metrics
        if out.prompt_logprobs is not None:
            done.prompt_logprobs = out.prompt_logprobs
            done.outputs_with_prompt_logprobs += 1
    return done


def run_engine(config: EngineConfig, jobs: list[tuple[object, SamplingParams]], **kwargs) -> list[Finished]:
    """Starts an engine, runs every job concurrently, stops the engine."""
    async def main() -> list[Finished]:
        async with AsyncEngine(config) as engine:
            return list(await asyncio.gather(*(collect(engine, p, s, **kwargs) for p, s in jobs)))
    return asyncio.run(main())


@functools.cache
def hf_model(model_dir: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt_ids: list[int], steps: int, vocab: int,
              device: str = "cpu") -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (full forward each step) over the first `vocab` ids, and
    each pick's logprob (the engine never samples the embedding's padding rows)."""
    model, ids, logprobs = hf_model(model_dir).to(device), list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1, :vocab].float().cpu()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt_ids):], logprobs


def cpu_config(model_dir: Path, **overrides) -> EngineConfig:
    # no pinned host tier by default: GPU test engines share one host (tier tests ask for one)
    base = dict(model=str(model_dir), device="cpu", block_size=4, cpu_cache_bytes=8 << 20,
                max_num_batched_tokens=256, max_num_seqs=16, segment_host_bytes=0)
    return EngineConfig(**{**base, **overrides})


def greedy(max_tokens: int, **overrides) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **overrides)


# A GPU test engine's gpu_memory_utilization: four pytest-xdist workers share one GPU, so each takes
# well under a quarter (tiny models need a few MiB; an engine also keeps 2 GiB for activations).
GPU_SHARE = 0.15
