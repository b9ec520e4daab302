"""The padded assembly step of AssemblyGraphs, run eagerly on CPU: padding rows (scratch slot and
page, zero tuples) must not change the request's logits nor its state."""
from __future__ import annotations

import logging
import re

import kimi_models
import mamba2_models
import pytest
from engine_util import GPU_SHARE, greedy
from pic_util import DOCS, QUERY, SEP, pic_config, prompt

import hypic.engine.pic.graphs as graphs_module
from hypic.engine.pic.graphs import MAX_PIECES, AssemblyGraphs
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt


def padded_engine(config, sizes: tuple[int, ...]) -> tuple[LLMEngine, list[int]]:
    """An engine whose assembly steps run padded (eagerly); the list collects each padded size."""
    engine = LLMEngine(config)
    runner = engine.runner
    graphs = AssemblyGraphs(runner.model, runner.caches, runner.store,
                            max_blocks=engine.max_model_len // config.block_size,
                            scratch_slot=engine.caches.num_slots - 1, scratch_block=engine.caches.num_blocks - 1,
                            max_tokens=engine.max_model_len, max_kv_len=engine.max_model_len, sizes=sizes,
                            use_graphs=False)
    graphs.capture()
    sizes_used: list[int] = []
    run = graphs.run

    def recording_run(forward):
        sizes_used.append(forward.num_tokens)
        return run(forward)
    graphs.run = recording_run
    runner.assembly_graphs = graphs
    return engine, sizes_used


def generate(engine: LLMEngine, text: str, max_tokens: int) -> tuple[list[int], list[float]]:
    return generate_together(engine, [text], max_tokens)[0]


def generate_together(engine: LLMEngine, texts: list[str], max_tokens: int, *, start_after: int = 0,
                      ) -> list[tuple[list[int], list[float]]]:
    """The first request, then (after `start_after` steps) the others at once, stepped to the end:
    each one's tokens and logprobs."""
    def add(text: str) -> str:
        return engine.add_request(SegmentedPrompt.build(engine.tokenizer, text, separator=SEP),
                                  greedy(max_tokens, logprobs=0))
    added, got, steps = [add(texts[0])], {}, 0
    while engine.has_work():
        if steps == start_after:
            added += [add(text) for text in texts[1:]]
        steps += 1
        for out in engine.step():
            tokens, logprobs = got.setdefault(out.request_id, ([], []))
            for delta in out.deltas:
                tokens += delta.token_ids
                logprobs += [lp.logprob for lp in delta.logprobs]
    return [got.get(rid, ([], [])) for rid in added]


def recorded_steps(engine: LLMEngine) -> list[tuple[int, int, int]]:
    """(step, padded size, requests it holds) of each assembly graph run, as the engine runs them."""
    graphs, seen = engine.runner.assembly_graphs, []
    run = graphs.run
    graphs.run = lambda forward: (seen.append((engine.steps, forward.num_tokens, forward.num_seqs - 1)), run(forward))[1]
    return seen


WARM = (prompt(DOCS[2], DOCS[0], DOCS[1]), prompt(DOCS[1], DOCS[2], query="the lazy dog"), prompt(DOCS[0], DOCS[2]),
        prompt(DOCS[1], DOCS[0], query="café"), prompt(DOCS[2], DOCS[1], DOCS[0], query="1234"))
SIZES = (32, 48, 64, 96, 128, 192, 256, 384)


def test_the_assemblies_of_one_step_share_padded_steps_of_up_to_four(slow_decay_model_dir):
    assert_grouped_steps_give_the_eager_tokens_and_logprobs(slow_decay_model_dir)


def assert_grouped_steps_give_the_eager_tokens_and_logprobs(model_dir, replays: tuple[int, ...] = (2, 4)) -> None:
    """Five warm requests admitted together: one engine step, padded steps of `replays` requests each
    (two, then three and a dummy; none: the step ran eagerly), with the tokens and logprobs of the
    eager batch."""
    config = pic_config(model_dir, max_num_batched_tokens=1024)  # room for all five
    eager = LLMEngine(config)
    generate(eager, prompt(*DOCS), 2)
    expected = generate_together(eager, [*WARM], 4)
    padded, _ = padded_engine(config, sizes=SIZES)
    generate(padded, prompt(*DOCS), 2)
    seen = recorded_steps(padded)
    got = generate_together(padded, [*WARM], 4)
    assert len({step for step, _, _ in seen}) == min(1, len(replays))
    assert tuple(requests for _, _, requests in seen) == replays
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_a_step_of_more_replays_than_the_limit_runs_as_one_eager_forward(slow_decay_model_dir, monkeypatch):
    """The five need two replays: with a limit of one, their step runs eagerly, with the same tokens."""
    monkeypatch.setattr(graphs_module, "MAX_REPLAYS", 1)
    assert_grouped_steps_give_the_eager_tokens_and_logprobs(slow_decay_model_dir, replays=())


def test_a_step_of_three_assemblies_fills_the_fourth_slot_with_a_dummy(slow_decay_model_dir, caplog):
    """Its padded step holds the three and a one-token dummy; the debug log says what the step held,
    how it ran and each part's time (the host's alone on a CPU)."""
    padded, _ = padded_engine(pic_config(slow_decay_model_dir), sizes=SIZES)
    generate(padded, prompt(*DOCS), 2)
    steps = padded.steps
    seen = recorded_steps(padded)
    caplog.set_level(logging.DEBUG, logger="hypic")
    generate_together(padded, [*WARM[:3]], 2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == padded.steps - steps and [requests for _, _, requests in seen] == [4]
    assert re.fullmatch(rf"step {steps + 1}: [\d.]+ ms, 3 assemblies \(\d+ tokens\); 1 assembly graph: [\d.]+ ms",
                        lines[0])
    assert re.fullmatch(rf"step {steps + 2}: [\d.]+ ms, 3 decodes; eager: [\d.]+ ms", lines[1])  # no decode graphs on CPU


def test_padded_assembly_step_gives_the_eager_tokens_and_logprobs(slow_decay_model_dir):
    assert_padded_steps_give_the_eager_tokens_and_logprobs(slow_decay_model_dir)


def assert_padded_steps_give_the_eager_tokens_and_logprobs(model_dir, query: str = QUERY,
                                                           sizes: tuple[int, ...] = (32, 40, 48, 56, 64, 88, 96, 128)
                                                           ) -> list[int]:
    """A cold request, then two warm ones, eagerly and with their assembly steps padded to `sizes`:
    the same tokens and logprobs. Returns the padded sizes used."""
    config = pic_config(model_dir)
    cold_then_warm = [prompt(*docs, query=query) for docs in (DOCS, (DOCS[2], DOCS[0], DOCS[1]), (DOCS[1], DOCS[2]))]
    eager = LLMEngine(config)
    expected = [generate(eager, p, 5) for p in cold_then_warm]
    padded, sizes_used = padded_engine(config, sizes=sizes)
    got = [generate(padded, p, 5) for p in cold_then_warm]
    assert len(sizes_used) >= 2 and len(set(sizes_used)) >= 2  # the warm requests ran padded, at two sizes
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
    return sizes_used


def test_mamba2_assemblies_of_one_step_share_padded_steps(tmp_path):
    """Nemotron 3 style (scalar family, relu2 experts): the dummies and padding change no request."""
    assert_grouped_steps_give_the_eager_tokens_and_logprobs(
        mamba2_models.make_model_dir(tmp_path, "nemotron_h", slow_decay=True))


def test_moe_blocks_skip_exactly_the_padding_rows(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Nemotron 3 style (relu2 experts): each padded step's MoE is told where its padding starts,
    and the tokens stay the eager engine's."""
    import hypic.models.layers as layers
    seen: list[tuple[int, int]] = []
    moe = layers.routed_moe

    def recording_moe(x, *args, valid_tokens=None, **kwargs):
        if valid_tokens is not None:
            seen.append((int(valid_tokens), x.shape[0]))
        return moe(x, *args, valid_tokens=valid_tokens, **kwargs)
    monkeypatch.setattr(layers, "routed_moe", recording_moe)
    config = pic_config(mamba2_models.make_model_dir(tmp_path, "nemotron_h", slow_decay=True))
    cold, warm = prompt(*DOCS), prompt(DOCS[2], DOCS[0], DOCS[1])
    eager = LLMEngine(config)
    expected = [generate(eager, p, 3)[0] for p in (cold, warm)]
    padded, sizes_used = padded_engine(config, sizes=(32, 64, 96, 128))
    seen.clear()  # the capture's warm-up steps
    assert [generate(padded, p, 3)[0] for p in (cold, warm)] == expected
    assert sizes_used and {rows for _, rows in seen} == set(sizes_used)
    assert all(0 < valid < rows for valid, rows in seen)


SHORT = ("the quick brown fox", "the quick brown fox jumps over the lazy dog")  # the second resumes the first


@pytest.mark.parametrize("family", ["gdn", "scalar", "kda"])
def test_short_prefills_are_walked_in_padded_steps_with_the_eager_tokens(family, slow_decay_model_dir, tmp_path):
    """A short prompt from a zero state, one resumed from its prefix checkpoint, and both beside a warm
    assembly in one step: walked in padded steps (composing nothing), with the eager engine's tokens
    and logprobs."""
    model_dir = {"gdn": lambda: slow_decay_model_dir,
                 "scalar": lambda: mamba2_models.make_model_dir(tmp_path, "nemotron_h", slow_decay=True),
                 "kda": lambda: kimi_models.make_model_dir(tmp_path, slow_decay=True)}[family]()
    config = pic_config(model_dir)
    runs = [[SHORT[0]], [SHORT[1]], [prompt(DOCS[2], DOCS[0], DOCS[1]), SHORT[1] + " again"]]
    eager = LLMEngine(config)
    generate(eager, prompt(*DOCS), 2)
    expected = [generate_together(eager, texts, 4) for texts in runs]
    padded, _ = padded_engine(config, sizes=SIZES)
    generate(padded, prompt(*DOCS), 2)
    seen = recorded_steps(padded)
    walks = []  # whether each padded step walks every row (a graph holds no chunked kernel)
    run = padded.runner.assembly_graphs.run
    padded.runner.assembly_graphs.run = lambda forward: (walks.append(forward.pic.assembly.walks_every_row),
                                                         run(forward))[1]
    got = [generate_together(padded, texts, 4) for texts in runs]
    assert [requests for _, _, requests in seen] == [1, 1, 2] and walks == [True] * 3  # each run's prefill step
    for want, have in zip(expected, got):
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(have, want):
            assert tokens == want_tokens
            assert logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_requests_a_graph_cannot_hold_run_eagerly(slow_decay_model_dir):
    config = pic_config(slow_decay_model_dir)
    engine, sizes_used = padded_engine(config, sizes=(32,))
    p = prompt(*DOCS)
    generate(engine, p, 2)
    generate(engine, p, 2)  # warm, but its assembly chunk has more than 31 tokens
    assert sizes_used == []
    assert MAX_PIECES >= len(DOCS)


@pytest.mark.gpu
def test_captured_assembly_graphs_match_the_eager_engine_on_cuda(slow_decay_model_dir):
    """Replays (capture-time host lengths, padded rows) against the same engine launched eagerly: warm
    assemblies, then short prefills (walked from a zero state, then from a prefix checkpoint)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cold_then_warm = [prompt(*DOCS), prompt(DOCS[2], DOCS[0], DOCS[1]), prompt(DOCS[1], DOCS[2]), *SHORT]
    base = dict(device="cuda", dtype="float32", block_size=16, gpu_memory_utilization=GPU_SHARE)
    eager = LLMEngine(pic_config(slow_decay_model_dir, enforce_eager=True, **base))
    expected = [generate(eager, p, 6) for p in cold_then_warm]
    del eager
    engine = LLMEngine(pic_config(slow_decay_model_dir, **base))
    graphs = engine.runner.assembly_graphs
    sizes_used: list[int] = []
    run = graphs.run
    graphs.run = lambda forward: (sizes_used.append(forward.num_tokens), run(forward))[1]
    got = [generate(engine, p, 6) for p in cold_then_warm]
    assert len(sizes_used) >= 4
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=2e-3)


@pytest.mark.gpu
def test_a_step_of_decodes_and_assemblies_replays_their_graphs_on_cuda(slow_decay_model_dir):
    """Five warm requests arriving while another decodes: their step replays the decode graph and two
    assembly graphs (the first one's logits kept from the second replay), with the eager tokens."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = dict(device="cuda", dtype="float32", block_size=16, gpu_memory_utilization=GPU_SHARE)
    texts = [prompt(DOCS[1], DOCS[0]), *WARM]
    runs = []
    for enforce_eager in (True, False):  # room for all five in one step
        engine = LLMEngine(pic_config(slow_decay_model_dir, enforce_eager=enforce_eager, max_num_batched_tokens=1024,
                                      **base))
        generate(engine, prompt(*DOCS), 2)
        replays: list[tuple[bool, tuple[int, ...]]] = []
        if not enforce_eager:
            replay = engine.runner._replay
            engine.runner._replay = lambda step: (
                replays.append((step.decodes is not None, tuple(len(one.chunks) - 1 for one in step.assemblies))),
                replay(step))[1]
        runs.append((generate_together(engine, texts, 8, start_after=3), replays))
        del engine
    (expected, _), (got, replays) = runs
    assert (True, (2, 4)) in replays, replays  # the decode graph, then graphs of two requests and of four
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=2e-3)
