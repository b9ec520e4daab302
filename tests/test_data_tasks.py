"""The notes task generator: determinism, split disjointness, kinds, and answerability."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import json

import jinja2
import pytest

from hypic.config import PIC_SEPARATOR
from hypic.data import EVAL_SPEC, KINDS, NotePool, TaskSpec, eval_prompts, is_correct, make_prompt, make_prompts
from hypic.data.notes import based_sentence
from hypic.data.tasks import POOL_REQUESTS, PREFIX_SEGMENT, QA, RIVAL_UNITS, reply_text

SMALL = TaskSpec(min_notes=2, max_notes=4, min_note_tokens=32, max_note_tokens=96, rich_names=False, questions=4)
MODEL_DIR = Path(__file__).resolve().parents[1] / "hypic" / "assets" / "default_model"


def test_same_seed_same_prompt_and_different_index_differs() -> None:
    assert make_prompt(EVAL_SPEC, "train", 7, seed=3) == make_prompt(EVAL_SPEC, "train", 7, seed=3)
    assert make_prompt(EVAL_SPEC, "train", 7, seed=3) != make_prompt(EVAL_SPEC, "train", 8, seed=3)
    assert make_prompt(EVAL_SPEC, "train", 7, seed=3) != make_prompt(EVAL_SPEC, "train", 7, seed=4)
    assert eval_prompts(3) == eval_prompts(3)


def test_splits_are_disjoint() -> None:
    texts = {split: {p.text() for p in make_prompts(SMALL, split, 60)} for split in ("train", "validation", "test")}
    assert not texts["train"] & texts["validation"] and not texts["train"] & texts["test"]
    assert not texts["validation"] & texts["test"]
    notes = {split: set(NotePool(EVAL_SPEC, split).notes[i].text for i in range(48)) for split in ("validation", "test")}
    assert not notes["validation"] & notes["test"]


def test_every_kind_is_generated() -> None:
    assert set(Counter(p.kind for p in make_prompts(EVAL_SPEC, "train", 80))) == set(KINDS)
    assert Counter(p.kind for p in eval_prompts(5)) == {k: 5 for k in KINDS}
    assert {qa.kind for p in make_prompts(SMALL, "train", 40) for qa in p.qas} == set(KINDS)


@pytest.mark.parametrize("spec", [SMALL, EVAL_SPEC])
def test_layout_and_answers_appear_where_they_should(spec: TaskSpec) -> None:
    prompts = make_prompts(spec, "validation", 40)
    assert all(spec.min_notes <= len(p.notes) <= spec.max_notes for p in prompts)
    for p in prompts + eval_prompts(4, "validation", spec=EVAL_SPEC):
        assert p.segments[0] == PREFIX_SEGMENT and p.segments[-1].startswith(f"Question: {p.qas[0].question}")
        assert all(PIC_SEPARATOR not in s for s in p.segments)
        for qa in p.qas:
            check_answerable(p.notes, qa)


def check_answerable(notes: tuple[str, ...], qa) -> None:
    holding = [i for i, n in enumerate(notes) if qa.answer in n]
    assert holding, qa
    if qa.kind == "linked":  # "The person above" opens the note right after the one signed by the person
        person = qa.question.removeprefix("Where does ").removesuffix(" work?")
        i = next(i for i in holding if notes[i].startswith(f"Note: The person above works at {qa.answer}."))
        assert i > 0 and notes[i - 1].endswith(f" Filed by {person}.\n")
    if qa.kind == "two_hop":
        person = qa.question.split("where ")[1].removesuffix(" lives?")
        home = next(i for i, n in enumerate(notes) if f"{person} lives in " in n)
        city = notes[home].split(f"{person} lives in ")[1].split(".")[0]
        assert any(based_sentence(city, qa.answer) in n for j, n in enumerate(notes) if j != home)
    if qa.kind == "long":  # a long note cut right before the value: the head ends one segment, the value opens the next
        i = next(i for i in holding if notes[i].startswith(f" {qa.answer}. "))
        assert i > 0 and notes[i - 1].startswith("Note: ")
        assert notes[i - 1].endswith(qa.evidence.removesuffix(f" {qa.answer}."))


def test_pool_requests_share_notes() -> None:
    prompts = eval_prompts(10)
    uses = Counter(note for p in prompts for note in p.notes)
    assert max(uses.values()) >= 3  # segments recur across requests, as PIC needs


def test_benchmark_pools_vary_the_facts() -> None:
    """Each POOL_REQUESTS requests of a kind draw on a pool of their own: more pools ask about more
    facts (one pool's linked questions are about its 4 pairs), and no note is in two pools."""
    def answers(prompts: list, kind: str) -> set[str]:
        return {p.answer for p in prompts if p.kind == kind}
    one, three = eval_prompts(POOL_REQUESTS), eval_prompts(3 * POOL_REQUESTS)
    assert three[:len(one)] == one
    for kind in ("linked", "long"):
        assert len(answers(three, kind)) > len(answers(one, kind))
    later = {note for p in three[len(one):] for note in p.notes}
    assert later and not later & {note for p in one for note in p.notes}


def units_of(kind: str, notes: tuple[str, ...]) -> int:
    """Linked pairs ("works at" notes) or cut long notes (second segments, which open inside a sentence)."""
    if kind == "linked":
        return sum(note.count("The person above works at") for note in notes)
    return sum(not note.startswith("Note: ") for note in notes)


@pytest.mark.parametrize("spec", [SMALL, EVAL_SPEC])
def test_linked_and_long_questions_have_rivals(spec: TaskSpec) -> None:
    """Beside the asked pair or long note sit RIVAL_UNITS others where max_notes allows (an only
    "works at" sentence would answer without reading who is above), in the benchmark's pool requests
    and in training prompts."""
    wide = replace(spec, min_notes=max(spec.min_notes, 6), max_notes=max(spec.max_notes, 6), questions=1)
    for kind in ("linked", "long"):
        requests = [p for p in eval_prompts(12, "validation", spec) if p.kind == kind]
        weights = tuple(float(k == kind) for k in KINDS)
        trained = make_prompts(replace(wide, kind_weights=weights), "train", 12)
        for p, most in [(p, spec.max_notes) for p in requests] + [(p, wide.max_notes) for p in trained]:
            assert len(p.notes) <= most
            seen = units_of(kind, p.notes)
            room = 1 + (most - 2) // 2  # pairs beside two fact-like notes
            assert seen >= min(3, room), (kind, seen, len(p.notes))  # the asked one and RIVAL_UNITS = 2 more


def test_strict_rivals_hold_in_crowded_prompts() -> None:
    """With strict_rivals, every linked or long question of a many-question prompt sits beside RIVAL_UNITS
    rivals of its structure; without it, a prompt that wants both kinds asks one of them beside none."""
    crowded = TaskSpec(3, 8, 24, 48, (1.0, 0.5, 3.0, 1.5), questions=6, strict_rivals=True)

    def rivals_of_asked(spec: TaskSpec) -> list[int]:
        return [units_of(qa.kind, p.notes) for p in make_prompts(spec, "train", 60) for qa in p.qas
                if qa.kind in ("linked", "long")]

    strict = rivals_of_asked(crowded)
    assert len(strict) > 40 and min(strict) >= 1 + RIVAL_UNITS
    assert min(rivals_of_asked(replace(crowded, strict_rivals=False))) == 1


def test_chat_template_renders_the_prompt_text() -> None:
    template = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    for p in eval_prompts(2):
        rendered = jinja2.Template(template).render(messages=p.chat_messages(), add_generation_prompt=True)
        assert rendered == p.text()


def test_reply_format_and_exact_match() -> None:
    assert reply_text(QA("Where does Derek live?", "Oslo", "lookup")) == "Answer: Oslo<|im_end|>"
    restated = QA("Where does Derek live?", "Oslo", "lookup", "Derek lives in Oslo.")
    assert reply_text(restated) == "Note: Derek lives in Oslo. Answer: Oslo<|im_end|>"
    assert is_correct("Answer: Oslo", "Oslo") and is_correct(" Answer: Oslo<|im_end|>", "Oslo")
    assert is_correct(reply_text(restated), "Oslo") and not is_correct("Derek lives in Oslo.", "Oslo")
    assert not is_correct("Answer: Oslo Harbor", "Oslo")


@pytest.mark.parametrize("spec", [SMALL, EVAL_SPEC])
def test_restated_replies_quote_the_notes_and_keep_the_prompt(spec: TaskSpec) -> None:
    """Restating changes only the replies: each evidence sentence is written in the notes, a linked
    reply quotes the seam between the anchor's signature and the dependent note, and the answer still scores."""
    plain, restated = (make_prompts(replace(spec, restate=r), "validation", 40) for r in (False, True))
    pooled = eval_prompts(3, "validation", replace(spec, restate=True))
    assert [p.segments for p in plain] == [p.segments for p in restated]
    assert all(not qa.evidence for p in plain for qa in p.qas)
    for p in restated + pooled:
        notes = "".join(p.notes)
        for qa in p.qas:
            assert all(s in notes for s in re.split(r"(?<=\.) ", qa.evidence)), qa
            if qa.kind == "linked":
                assert qa.evidence.replace(". The person", ".\nNote: The person") in notes
            assert is_correct(reply_text(qa), qa.answer)


def test_note_lengths_follow_the_spec_in_tokens() -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    whole = ["".join(p.notes).replace("\nNote: ", "\n\0Note: ").split("\0") for p in make_prompts(EVAL_SPEC, "test", 30)]
    lengths = [len(tokenizer.encode(n).ids) for notes in whole for n in notes]  # a cut long note counts whole
    assert min(lengths) >= 0.8 * EVAL_SPEC.min_note_tokens and max(lengths) <= 1.2 * EVAL_SPEC.max_note_tokens


def test_lookup_only_worlds_always_have_a_question() -> None:
    """A world drawn with only "Y hosts X" facts has nothing to ask; it is redrawn, not a crash."""
    spec = TaskSpec(2, 4, 32, 96, (1.0, 0.0, 0.0, 0.0), rich_names=False, questions=4, facts_per_note=(1, 2))
    prompts = make_prompts(spec, "train", 600)
    assert all(p.kind == "lookup" and p.answer for p in prompts)


def test_relations_restrict_the_random_facts() -> None:
    """Without "based" the notes hold no "hosts" sentence, so every city in them is a lookup answer."""
    spec = TaskSpec(2, 4, 32, 96, (1.0, 0.0, 0.0, 0.0), rich_names=False, questions=4, facts_per_note=(1, 2),
                    relations=("lives", "job", "code"))
    prompts = make_prompts(spec, "train", 200)
    assert not any(" hosts " in note for p in prompts for note in p.notes)
    assert {qa.question.split()[0] for p in prompts for qa in p.qas} == {"Where", "What"}
    with pytest.raises(ValueError):
        TaskSpec(relations=("lives", "hobby"))


def test_hosts_practice_asks_a_company_by_its_city() -> None:
    """The "hosts" practice relation is a based fact asked by its city: the note says "Oslo hosts Acme." and
    the restated reply quotes that sentence, so the second hop of a two-hop question is trained alone."""
    spec = TaskSpec(2, 3, 8, 16, (1.0, 0.0, 0.0, 0.0), rich_names=False, questions=4, facts_per_note=(2, 3),
                    relations=("hosts",), restate=True)
    prompts = make_prompts(spec, "train", 100)
    qas = [qa for p in prompts for qa in p.qas]
    assert qas and all(qa.question.startswith("Which company is based in ") for qa in qas)
    for p in prompts:
        for qa in p.qas:
            city = qa.question.removeprefix("Which company is based in ").removesuffix("?")
            assert qa.evidence == f"{city} hosts {qa.answer}."
            assert sum(qa.evidence in note for note in p.notes) == 1
