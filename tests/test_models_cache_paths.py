"""The model through its caches: decode steps, chunked prefill and mixed batches all equal one
from-scratch pass (transformers' logits of the whole sequence), on the trap-laden qwen3_next config."""
from __future__ import annotations

import pytest
import torch

from hypic.models.registry import load_model
from models_util import BatchBuilder, hf_logits, make_hf_model, random_ids, rel_err, run, save_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf = make_hf_model("qwen3_next", seed=3)
    path = save_checkpoint(hf, tmp_path_factory.mktemp("qwen3_next"))
    return hf, load_model(str(path), device=torch.device("cpu"), dtype=torch.float32)


def test_prefill_then_decode_steps_equal_one_forward(models) -> None:
    hf, model = models
    ids = random_ids(22, seed=4)
    builder = BatchBuilder(model.config)
    seq = builder.new_seq(slot=2)
    logits = [run(model, builder, [(seq, ids[:18])])]
    logits += [run(model, builder, [(seq, [token])]) for token in ids[18:]]  # crosses page boundaries
    assert rel_err(torch.cat(logits), hf_logits(hf, ids)) < TOL


def test_chunked_prefill_equals_unchunked(models) -> None:
    hf, model = models
    ids = random_ids(40, seed=5)
    builder = BatchBuilder(model.config)
    seq = builder.new_seq(slot=1)
    first = run(model, builder, [(seq, ids[:17])])
    second = run(model, builder, [(seq, ids[17:])])  # has_state True, 17 tokens already in the pages
    assert rel_err(torch.cat([first, second]), hf_logits(hf, ids)) < TOL


def test_mixed_batch_equals_each_sequence_alone(models) -> None:
    """One step holding two decodes, a second prefill chunk and a fresh prefill."""
    hf, model = models
    prompts = [random_ids(n, seed=10 + n) for n in (9, 14, 22, 11)]
    builder = BatchBuilder(model.config)
    seqs = [builder.new_seq(slot=s) for s in (6, 0, 3, 4)]
    run(model, builder, [(seqs[0], prompts[0][:8]), (seqs[1], prompts[1][:13]), (seqs[2], prompts[2][:10])])
    pieces = [(seqs[0], prompts[0][8:]), (seqs[1], prompts[1][13:]), (seqs[2], prompts[2][10:]),
              (seqs[3], prompts[3])]
    batch = builder.batch(pieces)
    assert (batch.num_decodes, batch.has_state.tolist()) == (2, [True, True, True, False])
    logits = model.compute_logits(model(batch, builder.caches))
    starts = batch.cu_seqlens.tolist()
    for b, (seq, tokens) in enumerate(pieces):
        expected = hf_logits(hf, prompts[b])[-len(tokens):]
        assert rel_err(logits[starts[b]:starts[b + 1]], expected) < TOL, f"sequence {b}"


def test_logits_indices_select_rows(models) -> None:
    _, model = models
    ids = random_ids(12, seed=6)
    builder = BatchBuilder(model.config)
    full = run(model, builder, [(builder.new_seq(slot=0), ids)])
    batch = builder.batch([(builder.new_seq(slot=1), ids)])
    batch.logits_indices = torch.tensor([11, 4])
    hidden = model(batch, builder.caches)
    assert hidden.shape == (2, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), full[[11, 4]], rtol=1e-5, atol=1e-5)
