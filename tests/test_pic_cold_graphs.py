"""The padded cold chunk of ColdGraphs, run eagerly on CPU: a cold job's chunk padded within its own
sequence (inert rows, the scratch page, no expert) must store the tuple, and serve the tokens, that
the eager chunk does, across a capture of several chunks with a decode beside each."""
from __future__ import annotations

import mamba2_models
import pytest
from conftest import make_model_dir
from engine_util import GPU_SHARE, greedy
from pic_util import DOCS, SEP, SYSTEM, pic_config, rel

from hypic.engine.cuda_graphs import DecodeGraphs
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.cold_graphs import ColdGraphs
from hypic.engine.pic.segments import SegmentedPrompt

LONG_DOC = " ".join(DOCS)  # ~300 tokens: ten chunks of a 32-token budget, each padded to 48 or 64 rows
SIZES = (48, 64)


@pytest.fixture(scope="module")
def slow_moe_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_model_dir(tmp_path_factory.mktemp("slow_moe_cold_graphs"), kind="qwen3_next", slow_decay=True)


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory: pytest.TempPathFactory):
    return mamba2_models.make_model_dir(tmp_path_factory.mktemp("nemotron_cold_graphs"), "nemotron_h",
                                        slow_decay=True)


def padded_engine(config) -> tuple[LLMEngine, list[tuple[int, int]]]:
    """An engine whose decodes and cold chunks run padded (eagerly); the list collects each cold chunk's
    (real rows, step)."""
    engine = LLMEngine(config)
    runner = engine.runner
    scratch = dict(max_blocks=engine.max_model_len // config.block_size, scratch_slot=engine.caches.num_slots - 1,
                   scratch_block=engine.caches.num_blocks - 1, max_kv_len=engine.max_model_len, use_graphs=False)
    runner.graphs = DecodeGraphs(runner.model, runner.caches, max_num_seqs=4, **scratch)
    graphs = ColdGraphs(runner.model, runner.caches, runner.store, max_tokens=engine.max_model_len, sizes=SIZES,
                        **scratch)
    runner.graphs.capture()
    graphs.capture()
    runs: list[tuple[int, int]] = []
    run = graphs.run

    def recording_run(scheduled, index):
        runs.append((scheduled.chunk.num_tokens, engine.steps))
        return run(scheduled, index)
    graphs.run = recording_run
    runner.cold_graphs = graphs
    return engine, runs


def cold_run(engine: LLMEngine) -> tuple[dict, list[int], list[float], list[int]]:
    """LONG_DOC prefilled cold for one request while another decodes: the stored tuple, the cold
    request's tokens and logprobs, and the decoder's tokens."""
    decoder = engine.add_request(SegmentedPrompt.build(engine.tokenizer, "hello world", separator=SEP), greedy(40))
    engine.step()
    prompt = SegmentedPrompt.build(engine.tokenizer, SEP.join([SYSTEM, LONG_DOC, "the lazy dog"]), separator=SEP)
    job, = engine.segment_jobs(prompt)
    cold = engine.add_request(prompt, greedy(4, logprobs=0))
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens, logprobs = got.setdefault(out.request_id, ([], []))
            for delta in out.deltas:
                tokens += delta.token_ids
                logprobs += [lp.logprob for lp in delta.logprobs or []]
    tup = engine.export_segment(job.key)
    stored = {name: getattr(tup, name) for name in ("T", "S0", "conv_tail", "K", "V")}
    return stored, *got[cold], got[decoder][0]


@pytest.mark.parametrize("model", ["gdn", "moe", "mamba2"])
def test_padded_cold_chunks_store_the_eager_tuple_and_serve_its_tokens(model, slow_decay_model_dir, slow_moe_dir,
                                                                       nemotron_dir):
    """Slow decay: T far from 0 at the segment's end. The MoE model's padding rows go to no expert."""
    model_dir = {"gdn": slow_decay_model_dir, "moe": slow_moe_dir, "mamba2": nemotron_dir}[model]
    config = pic_config(model_dir, max_num_batched_tokens=32)
    want, want_tokens, want_logprobs, want_decoded = cold_run(LLMEngine(config))
    padded, runs = padded_engine(config)
    got, tokens, logprobs, decoded = cold_run(padded)
    assert len(runs) >= 8 and all(n < 48 for n, _ in runs)  # every chunk padded, each in its own step
    assert len({step for _, step in runs}) == len(runs)
    for name, layers in want.items():
        assert len(got[name]) == len(layers)
        for g, w in zip(got[name], layers):
            assert g.shape == w.shape and w.norm() > 0 and rel(g.float(), w.float()) <= 1e-5, name
    assert (tokens, decoded) == (want_tokens, want_decoded)
    assert logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_a_naive_jobs_chunks_run_eagerly(slow_decay_model_dir):
    """A naive job stores T = I at its end, which the graphs do not capture."""
    padded, runs = padded_engine(pic_config(slow_decay_model_dir, max_num_batched_tokens=32, cache_mode="naive"))
    stored = cold_run(padded)[0]
    assert runs == [] and stored["S0"]


@pytest.mark.gpu
def test_captured_cold_graphs_store_the_eager_tuple_on_cuda(slow_decay_model_dir):
    """Replays (FLA's chunked kernels at the captured length, inert padding, the prior from static
    buffers) against the same engine launched eagerly, in bfloat16: every chunk of 32 tokens or fewer
    beside a decode replays the 64-row graph."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=64, gpu_memory_utilization=GPU_SHARE)
    want, want_tokens, _, want_decoded = cold_run(LLMEngine(pic_config(slow_decay_model_dir, enforce_eager=True,
                                                                       **base)))
    engine = LLMEngine(pic_config(slow_decay_model_dir, **base))
    graphs, runs = engine.runner.cold_graphs, []
    assert graphs.sizes == (64,)
    run = graphs.run
    graphs.run = lambda scheduled, index: (runs.append(index), run(scheduled, index))[1]
    got, tokens, _, decoded = cold_run(engine)
    assert len(runs) >= 4 and set(runs) == {1}  # each beside the decode
    for name, layers in want.items():
        for g, w in zip(got[name], layers, strict=True):
            assert w.norm() > 0 and rel(g.float(), w.float()) <= 2e-2, name
    assert (tokens, decoded) == (want_tokens, want_decoded)
