"""Training batches (scripts/train/train_data.py): the loss covers exactly the replies, and their value tokens
are the tokens the notes state."""
from __future__ import annotations

import re
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "train"
sys.path.insert(0, str(SCRIPTS))

import numpy as np
from tokenizers import Tokenizer  # noqa: E402
from train_data import STAGES, collate, encode  # noqa: E402

from hypic.data import KINDS, make_prompt  # noqa: E402
from hypic.data.tasks import reply_text  # noqa: E402

MODEL_DIR = SCRIPTS.parents[1] / "hypic" / "assets" / "default_model"
FACT = {"Where": r" {name} lives in (\w+)\.", "job?": r" {name} works as an? (\w+)\.",
        "code?": r" {name}'s locker code is (\d+)\."}


def test_supervised_tokens_are_the_replies_and_copy_the_notes() -> None:
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    prompts = [make_prompt(STAGES[2].extra[0][0], "train", i) for i in range(2)]
    rows = [encode(tokenizer, p, all_questions=True) + ([KINDS.index(qa.kind) for qa in p.qas], True) for p in prompts]
    batch = collate(rows, 64)
    width = batch.ids.shape[1]
    assert (batch.ids.reshape(-1)[batch.positions + 1] == batch.targets).all()  # each position predicts the next token
    for b, p in enumerate(prompts):
        mine = batch.positions // width == b
        answers = batch.answer[mine]
        for a, qa in zip(sorted(set(answers.tolist())), p.qas):
            reply_ids = batch.targets[mine][answers == a].tolist()
            assert tokenizer.decode(reply_ids, skip_special_tokens=False) == reply_text(qa)
            assert qa.evidence and qa.answer in qa.evidence  # restated: the sentence of the note comes first
            key = "Where" if qa.question.startswith("Where") else qa.question.split()[-1]
            name = qa.question.split()[2].removesuffix("'s")
            stated = re.findall(FACT[key].format(name=name), " ".join(p.notes))
            assert stated == [qa.answer]  # the fact about the asked name, stated once, holds the gold answer
            evidence = tokenizer.encode(f" {qa.evidence}", add_special_tokens=False).ids
            context = rows[b][0][: rows[b][1][0][0]]
            assert any(context[i: i + len(evidence)] == evidence for i in range(len(context)))  # the note's tokens
            assert evidence == reply_ids[2: 2 + len(evidence)]  # after "Note", ":"
        # supervised tokens are the replies and nothing else: as many as the replies have
        assert mine.sum() == sum(len(tokenizer.encode(reply_text(qa), add_special_tokens=False).ids) for qa in p.qas)


def test_mix_override_and_practice_tags() -> None:
    """--practice-share / --replay (train_data.with_mix): the shares change, the prompts of a source do not;
    each answer carries whether it came from practice and its lookup relation (the log's em_practice)."""
    import random

    import pytest
    from train_data import (
        LOOKUP_SIMPLE,
        RELATIONS,
        init_worker,
        make_group,
        relation_index,
        stage_spec,
        with_mix,
    )

    only_practice = with_mix(STAGES, 2, practice=1.0, replay=0.0)
    assert only_practice[2].spec == STAGES[2].spec and only_practice[1] == STAGES[1] and only_practice[3] == STAGES[3]
    assert only_practice[2].extra[0] == (LOOKUP_SIMPLE, 1.0) and only_practice[2].replay == 0.0
    rng = random.Random(0)
    assert {stage_spec(rng, 2, only_practice) for _ in range(200)} == {("extra", LOOKUP_SIMPLE)}
    mixed = with_mix(STAGES, 2, practice=0.7, replay=0.1)
    rng = random.Random(1)
    sources = [stage_spec(rng, 2, mixed)[0] for _ in range(4000)]
    assert abs(sources.count("replay") / 4000 - 0.1) < 0.03
    assert abs(sources.count("extra") / 4000 - 0.63) < 0.03
    assert with_mix(STAGES, 2) == STAGES  # nothing given: unchanged
    with pytest.raises(ValueError):
        with_mix(STAGES, 2, practice=1.2)
    with pytest.raises(ValueError):
        with_mix(STAGES, 0, practice=0.5)  # stage 0 has no practice spec

    init_worker(str(MODEL_DIR / "tokenizer.json"))
    batches = make_group(2, seed=0, group=3, token_budget=4096, multiple=64, stages=mixed)
    extra = np.concatenate([b.extra for b in batches])
    rel = np.concatenate([b.rel for b in batches])
    kinds = np.concatenate([b.kinds for b in batches])
    current = np.concatenate([b.current for b in batches])
    assert extra.any() and current.any() and not (extra & current).any()
    other = RELATIONS.index("other")
    assert (kinds[extra] == KINDS.index("lookup")).all() and (rel[extra] != other).all()  # practice: lookups only
    assert ((rel == other) == (kinds != KINDS.index("lookup"))).all()
    assert relation_index("lookup", "Where does Mona live?") == RELATIONS.index("lives")
    assert relation_index("lookup", "What is Mona's job?") == RELATIONS.index("job")
    assert relation_index("lookup", "What is Mona's locker code?") == RELATIONS.index("code")
    assert relation_index("lookup", "Which company is based in Oslo?") == RELATIONS.index("hosts")
    assert relation_index("long", "What is Mona's locker code?") == RELATIONS.index("other")
    old_style = collate([r[:4] for r in [encode_row(p) for p in [make_prompt(LOOKUP_SIMPLE, "train", 0)]]], 64)
    assert not old_style.extra.any() and (old_style.rel == other).all()  # 4-tuple rows (probe, eval) still collate


def encode_row(prompt) -> tuple:
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    return encode(tokenizer, prompt, all_questions=True) + ([KINDS.index(qa.kind) for qa in prompt.qas], True)


def test_value_classes_and_embedding_respread() -> None:
    """Single-token value classes, and respread_rows / collapse_rows (train_model.py --respread)."""
    import torch
    from train_data import VALUE_CLASSES, class_token_ids
    from train_net import collapse_rows, deviation_norm, respread_rows

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = {name: class_token_ids(tokenizer, name) for name in VALUE_CLASSES}
    assert all(len(set(v)) == len(VALUE_CLASSES[n]) for n, v in ids.items())
    assert tokenizer.decode([ids["cities"][0]]) == " " + VALUE_CLASSES["cities"][0]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3072, 256, generator=g) * 0.02
    rows, others = ids["cities"], ids["companies"]
    untouched = weight[others].clone()
    collapse_rows(weight, rows, 3.0, g)
    x = torch.nn.functional.normalize(weight[rows], dim=-1)
    assert (x @ x.T).mean() > 0.85  # collapsed: one shared direction
    mean = weight[rows].mean(0).clone()
    respread_rows(weight, rows, 1.5, g)
    torch.testing.assert_close(weight[rows].mean(0), mean)  # the class mean (the type the layers read) stays
    assert abs(deviation_norm(weight, rows) - 1.5) < 0.3
    x = torch.nn.functional.normalize(weight[rows], dim=-1)
    assert (x @ x.T).fill_diagonal_(0).mean() < 0.5
    assert torch.equal(weight[others], untouched)


def test_practice_has_no_based_facts_and_relation_weights() -> None:
    """The practice spec (LOOKUP_SIMPLE) states no "<city> hosts X" facts, so every city in a practice
    context answers a lookup; --practice-relations (with_mix) reweights the practice facts by repetition."""
    import collections
    import re

    import pytest
    from train_data import LOOKUP_SIMPLE, with_mix

    from hypic.data.tasks import make_prompts

    assert STAGES[2].extra[0][0] is LOOKUP_SIMPLE and "based" not in LOOKUP_SIMPLE.relations
    prompts = make_prompts(LOOKUP_SIMPLE, "train", 300)
    assert not any(" hosts " in note for p in prompts for note in p.notes)

    def question_relations(spec) -> collections.Counter:
        return collections.Counter(qa.question.split()[0] + ("job" if qa.question.endswith("job?") else "")
                                   for p in make_prompts(spec, "train", 300) for qa in p.qas)

    weighted = with_mix(STAGES, 2, practice=0.7, practice_relations=("lives", "lives", "job", "code"))
    spec = weighted[2].extra[0][0]
    assert weighted[2].extra[0][1] == 0.7 and spec.relations == ("lives", "lives", "job", "code")
    assert (spec.min_notes, spec.max_note_tokens, spec.questions) == (2, 16, 4)  # only the relations change
    assert weighted[2].spec == STAGES[2].spec and weighted[2].replay == STAGES[2].replay
    base, more = question_relations(LOOKUP_SIMPLE), question_relations(spec)

    def share(c: collections.Counter) -> float:  # "Where does X live?"
        return c["Where"] / sum(c.values())

    assert 0.25 < share(base) < 0.42 and 0.42 < share(more) < 0.6
    assert all(re.search(r" lives in | works as | locker code is ", "".join(p.notes))
               for p in make_prompts(spec, "validation", 50))
    with pytest.raises(ValueError):
        with_mix(STAGES, 0, practice_relations=("lives",))  # stage 0 has no practice spec


def test_practice_note_tokens_lengthen_only_the_practice_notes() -> None:
    """--practice-note-tokens (with_mix): the practice spec's notes get the given lengths, all else stays."""
    import pytest
    from train_data import PAIRS_PRACTICE, with_mix

    from hypic.data.tasks import make_prompts

    longer = with_mix(STAGES, 6, practice_note_tokens=(64, 96))
    spec = longer[6].extra[0][0]
    assert STAGES[6].extra[0][0] is PAIRS_PRACTICE and (spec.min_note_tokens, spec.max_note_tokens) == (64, 96)
    assert spec.kind_weights == PAIRS_PRACTICE.kind_weights and longer[6].spec == STAGES[6].spec
    assert longer[6].extra[0][1] == STAGES[6].extra[0][1]

    def mean_note_chars(s) -> float:
        notes = [note for p in make_prompts(s, "train", 40) for note in p.notes]
        return sum(map(len, notes)) / len(notes)

    assert mean_note_chars(spec) > 1.5 * mean_note_chars(PAIRS_PRACTICE)
    with pytest.raises(ValueError):
        with_mix(STAGES, 0, practice_note_tokens=(64, 96))  # stage 0 has no practice spec


def test_mlp_neuron_cap() -> None:
    """train_model.py --cap-mlp: mlp_neuron_peaks finds a neuron that dominates the residual at answer positions,
    cap_mlp_neurons scales only its down_proj column so that its peak equals the cap."""
    import json

    import torch
    from train_net import Qwen35ForTraining, cap_mlp_neurons, mlp_neuron_peaks

    torch.manual_seed(0)
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    cfg.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=64)
    net = Qwen35ForTraining(cfg).eval()
    down = net.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        down[:, 7] *= 1000.0
    sequences = [(list(range(3, 40)), [10, 20, 30]), (list(range(5, 30)), [4, 24])]
    peaks = mlp_neuron_peaks(net, sequences)
    assert [p.shape[0] for p in peaks] == [cfg["intermediate_size"]] * 2
    assert peaks[1].argmax().item() == 7
    cap = 2 * peaks[1].topk(2).values[1].item()  # above every other neuron
    before = down.detach().clone()
    capped = cap_mlp_neurons(net, [torch.zeros_like(peaks[0]), peaks[1]], cap)
    assert [(layer, neuron) for layer, neuron, _ in capped] == [(1, 7)]
    changed = (down.detach() != before).any(0)
    assert changed.nonzero().flatten().tolist() == [7]
    after = mlp_neuron_peaks(net, sequences)
    assert abs(after[1][7].item() - cap) < 1e-3 * cap and torch.equal(after[0], peaks[0])
