"""A GPU engine step waits for the device once: the read of its sampled ids (issue 29). Every other
host sync in a prefill or decode step (a pageable copy, .item(), .tolist(), nonzero, ...) would
stop the host from queueing the step's work ahead of the GPU; torch's sync debug mode names them.
Constrained steps too: their grammar masks reach the GPU in pinned copies (issue 25)."""
from __future__ import annotations

import logging
import random
import re

import pytest
import torch

from hypic import EngineConfig, SamplingParams
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.kernels.host_copy import sync_sites
from hypic.structured_outputs import StructuredOutputs

from engine_util import GPU_SHARE

pytestmark = pytest.mark.gpu

PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FILTERED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.2,
                          presence_penalty=0.5, logit_bias={5: 2.0}, logprobs=3, ignore_eos=True)
CONSTRAINED = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             structured=StructuredOutputs("regex", "[a-z]{20}"))


def submit(engine: LLMEngine, params: SamplingParams, rng: random.Random) -> None:
    for length in (40, 75, 120):
        ids = [rng.randrange(3, 250) for _ in range(length)]
        engine.add_request(SegmentedPrompt.build(engine.tokenizer, ids, separator=engine.config.segment_separator),
                           params)


@pytest.mark.parametrize("params", [PLAIN, FILTERED, CONSTRAINED], ids=["greedy", "filtered", "constrained"])
def test_prefill_and_decode_steps_read_the_device_once(tiny_moe_model_dir, params):
    engine = LLMEngine(EngineConfig(model=str(tiny_moe_model_dir), device="cuda", cache_mode="none",
                                    gpu_memory_utilization=GPU_SHARE, max_num_seqs=4, segment_host_bytes=0))
    rng = random.Random(0)
    submit(engine, params, rng)  # a first round compiles, autotunes and picks tilings (syncs, once)
    while engine.has_work():
        engine.step()
    submit(engine, params, rng)
    torch.cuda.synchronize()
    prefill = sync_sites(engine.step)  # the three prompts in one step
    decodes = [sync_sites(engine.step) for _ in range(3)]  # CUDA-graph decode steps
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    assert len(prefill) == 1, prefill
    assert [len(d) for d in decodes] == [1, 1, 1], decodes


def test_a_step_of_decodes_and_warm_assemblies_reads_the_device_once(tiny_moe_model_dir, caplog):
    """Its decode graph and assembly graph replays, and the copies between them, queue without a sync."""
    engine = LLMEngine(EngineConfig(model=str(tiny_moe_model_dir), device="cuda", gpu_memory_utilization=GPU_SHARE,
                                    max_num_seqs=8, segment_host_bytes=0))
    rng = random.Random(0)
    system, docs = [rng.randrange(3, 250) for _ in range(16)], [[rng.randrange(3, 250) for _ in range(64)] for _ in range(3)]

    def rag(order: list[int]) -> None:
        question = [rng.randrange(3, 250) for _ in range(12)]
        engine.add_request(SegmentedPrompt.build(engine.tokenizer, [system, *(docs[i] for i in order), question],
                                                  separator=engine.config.segment_separator), PLAIN)
    for _ in range(2):  # the documents' capture, then a warm round: compiles and tunes what warm steps run
        rag([0, 1, 2])
        while engine.has_work():
            engine.step()
    rag([2, 0, 1])
    engine.step()  # its assembly; it decodes from the next step on
    rag([1, 2, 0])
    rag([0, 2, 1])
    torch.cuda.synchronize()
    sites = sync_sites(engine.step)
    assert engine.runner.launched == "decode graph + 1 assembly graph"
    assert len(sites) == 1, sites
    caplog.set_level(logging.DEBUG, logger="hypic")  # each part's host and device times, in the step log
    rag([1, 0, 2])  # an order not seen yet: no prefix checkpoint covers its documents
    engine.step()
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")][-1]
    assert re.search(r"; decode graph \+ 1 assembly graph: [\d.]+/[\d.]+, [\d.]+/[\d.]+ ms, host/device$", line), line
