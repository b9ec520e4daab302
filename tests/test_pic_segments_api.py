"""The segment API peers use: build tuples on one engine, import them into another."""
from __future__ import annotations

import asyncio

import pytest
from engine_util import collect
from pic_util import DOCS, pic_config, prompt

from hypic import AsyncEngine


def test_tuples_built_on_one_engine_serve_another_identically(slow_decay_model_dir):
    text = prompt(*DOCS)
    params = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)

    async def main():
        from hypic import SamplingParams
        config = pic_config(slow_decay_model_dir)
        async with AsyncEngine(config) as worker, AsyncEngine(config) as combine:
            jobs = worker.segment_jobs(text)
            assert len(jobs) == 3 and not any(j.cached for j in jobs)
            tuples = await worker.build_segments(jobs)
            assert all(t is not None for t in tuples)
            assert all(j.cached for j in worker.segment_jobs(text))
            for job, tup in zip(jobs, tuples):
                assert await combine.import_segment(job.key, tup)
            served = await collect(combine, text, SamplingParams(**params))
            local = await collect(worker, text, SamplingParams(**params))
            flushed = await combine.flush_segments()
            return served, local, flushed
    served, local, flushed = asyncio.run(main())
    assert served.metrics.cached_tokens_by_kind["pic"] == local.metrics.cached_tokens_by_kind["pic"] > 0
    assert served.tokens == local.tokens
    assert [x.logprob for x in served.logprobs[0]] == pytest.approx([x.logprob for x in local.logprobs[0]], abs=1e-6)
    assert flushed == 3
