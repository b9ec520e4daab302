"""The padded cold chunk of ColdGraphs, run eagerly on CPU: a cold job's chunk padded within its own
sequence (inert rows, the scratch page, no expert) must store the tuple, and serve the tokens, that
the eager chunk does, across a capture of several chunks with a decode beside each."""
from __future__ import annotations

import mamba2_models
import pytest
from conftest import make_model_dir
from engine_util import GPU_SHARE, greedy
from pic_util import DOCS, SEP, SYSTEM, pic_config, rel
from test_pic_chunked_capture import _accounting

from hypic.engine.cuda_graphs import DecodeGraphs
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.cold_graphs import ColdGraphs
from hypic.engine.pic.segments import SegmentedPrompt

LONG_DOC = " ".join(DOCS)  # ~300 tokens: ten chunks of a 32-token budget, each padded to 48 or 64 rows
SIZES = (48, 64, 128)


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


def cold_run(engine: LLMEngine, docs: tuple[str, ...] = (LONG_DOC,), *, decoder: bool = True
             ) -> tuple[list[dict], list[list[int]], list[list[float]], list[int]]:
    """Each of `docs` prefilled cold for a request of its own (all added at once), while another request
    decodes if `decoder`: each one's stored tuple, each request's tokens and logprobs, and the
    decoder's tokens."""
    if decoder:
        decoding = engine.add_request(SegmentedPrompt.build(engine.tokenizer, "hello world", separator=SEP),
                                      greedy(40))
        engine.step()
    prompts = [SegmentedPrompt.build(engine.tokenizer, SEP.join([SYSTEM, doc, "the lazy dog"]), separator=SEP)
               for doc in docs]
    keys = [job.key for prompt in prompts for job in engine.segment_jobs(prompt)]
    cold = [engine.add_request(prompt, greedy(4, logprobs=0)) for prompt in prompts]
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens, logprobs = got.setdefault(out.request_id, ([], []))
            for delta in out.deltas:
                tokens += delta.token_ids
                logprobs += [lp.logprob for lp in delta.logprobs or []]
    exported = [engine.export_segment(key) for key in keys]
    stored = [{name: getattr(tup, name) for name in ("T", "S0", "conv_tail", "K", "V")} for tup in exported]
    return stored, [got[rid][0] for rid in cold], [got[rid][1] for rid in cold], got[decoding][0] if decoder else []


def assert_same_tuples(got: list[dict], want: list[dict], tolerance: float) -> None:
    assert len(got) == len(want)
    for one, other in zip(got, want):
        for name, layers in other.items():
            assert len(one[name]) == len(layers)
            for g, w in zip(one[name], layers):
                assert g.shape == w.shape and w.norm() > 0 and rel(g.float(), w.float()) <= tolerance, name


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
    assert_same_tuples(got, want, 1e-5)
    assert (tokens, decoded) == (want_tokens, want_decoded)
    assert logprobs[0] == pytest.approx(want_logprobs[0], abs=1e-5)


def test_two_cold_chunks_of_one_step_replay_a_graph_each(slow_decay_model_dir):
    """Two cold documents at once and nothing else in flight (no long-prefill cap, which would hold a
    step to one job): a job ending within a step's budget leaves the rest of it to the other, so some
    steps hold a chunk of each (a replay and a capture each)."""
    config = pic_config(slow_decay_model_dir, max_num_batched_tokens=128)
    docs = (LONG_DOC, " ".join(reversed(DOCS)))
    want, want_tokens, want_logprobs, _ = cold_run(LLMEngine(config), docs, decoder=False)
    padded, runs = padded_engine(config)
    got, tokens, logprobs, _ = cold_run(padded, docs, decoder=False)
    steps = [step for _, step in runs]
    assert any(steps.count(step) == 2 for step in steps)
    assert_same_tuples(got, want, 1e-5)
    assert tokens == want_tokens
    for one, other in zip(logprobs, want_logprobs):
        assert one == pytest.approx(other, abs=1e-5)


def test_a_naive_jobs_chunks_run_eagerly(slow_decay_model_dir):
    """A naive job stores T = I at its end, which the graphs do not capture."""
    padded, runs = padded_engine(pic_config(slow_decay_model_dir, max_num_batched_tokens=32, cache_mode="naive"))
    stored = cold_run(padded)[0]
    assert runs == [] and stored[0]["S0"]


@pytest.mark.gpu
def test_captured_cold_graphs_store_the_eager_tuple_on_cuda(slow_decay_model_dir):
    """Replays (FLA's chunked kernels at the captured length, inert padding, the prior from static
    buffers) against the same engine launched eagerly, in bfloat16: every chunk of up to 64 tokens
    beside a decode replays the 64-row graph, on the cold lane's stream while the decode's graph
    replays on another (hypic.engine.pic.cold_lane)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=64, gpu_memory_utilization=GPU_SHARE)
    want, want_tokens, _, _ = cold_run(LLMEngine(pic_config(slow_decay_model_dir, enforce_eager=True, **base)))
    engine = LLMEngine(pic_config(slow_decay_model_dir, **base))
    graphs, runs = engine.runner.cold_graphs, []
    assert graphs.sizes == (64,)
    run = graphs.run
    lane = engine.runner.lane.stream
    graphs.run = lambda scheduled, index: (runs.append((index, torch.cuda.current_stream() == lane)),
                                           run(scheduled, index))[1]
    got, tokens, _, _ = cold_run(engine)
    assert len(runs) >= 4 and set(runs) == {(1, True)}  # each beside the decode, on the lane
    assert not engine.runner.lane.busy and not engine.scheduler.running
    assert_same_tuples(got, want, 2e-2)
    # the cold request's tokens; not the decoder's: eagerly its rows ran in the mixed batch's kernels,
    # here in the decode graph's fused ones, and in bfloat16 a long greedy run parts at a near tie
    assert tokens == want_tokens


@pytest.mark.gpu
def test_an_abort_while_a_cold_chunk_runs_on_the_lane_gives_everything_back(slow_decay_model_dir):
    """The request that brought the cold document is aborted while its job's chunk is on the lane: the
    job is dropped before its captures land, which are then let go; the decoder goes on."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = LLMEngine(pic_config(slow_decay_model_dir, device="cuda", dtype="bfloat16", max_num_batched_tokens=64,
                                  gpu_memory_utilization=GPU_SHARE))
    baseline = _accounting(engine)
    decoder = engine.add_request(SegmentedPrompt.build(engine.tokenizer, "hello world", separator=SEP),
                                 greedy(40), cache_mode="none")
    engine.step()
    prompt = SegmentedPrompt.build(engine.tokenizer, SEP.join([SYSTEM, LONG_DOC, "the lazy dog"]), separator=SEP)
    cold = engine.add_request(prompt, greedy(4))
    while not engine.runner.lane.busy:
        engine.step()
    engine.abort(cold)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(d.token_ids) for out in engine.step() if out.request_id == decoder for d in out.deltas)
    assert not engine.runner.lane.busy and tokens > 0
    assert _accounting(engine) == baseline


def test_only_families_checked_in_graphs_capture_cold_chunks(slow_decay_model_dir, nemotron_dir):
    """Gated DeltaNet's kernels are checked in graphs on the H200; Mamba2's cold chunks stay eager, and
    so does a float32 model's (its prefills take the torch references)."""
    gdn, mamba2 = (LLMEngine(pic_config(d, dtype="bfloat16")) for d in (slow_decay_model_dir, nemotron_dir))
    assert ColdGraphs.holds(gdn.model, gdn.store.layout)
    assert not ColdGraphs.holds(mamba2.model, mamba2.store.layout)
    fp32 = LLMEngine(pic_config(slow_decay_model_dir))
    assert not ColdGraphs.holds(fp32.model, fp32.store.layout)


def test_index_tensors_a_capture_reads_are_kept_after_their_cache_drops_them():
    """A graph reads the offsets it captured at every replay: what `step_cache` returns during a capture
    stays referenced after sixteen newer lengths push it out of the cache; outside one, nothing is kept."""
    import torch

    from hypic.kernels import varlen
    with varlen.graph_capture():
        captured = varlen.fla_cu_seqlens((7, 5), torch.device("cpu"))
    outside = varlen.fla_cu_seqlens((3, 2), torch.device("cpu"))
    for n in range(1, 17):
        varlen.fla_cu_seqlens((n,), torch.device("cpu"))
    kept = list(varlen._held.values())
    assert any(value is captured for value in kept) and not any(value is outside for value in kept)
    assert varlen.fla_cu_seqlens((7, 5), torch.device("cpu")) is not captured  # the cache did drop it
