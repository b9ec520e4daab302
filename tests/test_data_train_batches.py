"""Training batches (scripts/train_data.py): the loss covers exactly the replies, and their value tokens
are the tokens the notes state."""
from __future__ import annotations

import re
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from tokenizers import Tokenizer  # noqa: E402
from train_data import STAGES, collate, encode  # noqa: E402

from hypic.data import KINDS, make_prompt  # noqa: E402

MODEL_DIR = SCRIPTS.parent / "hypic" / "assets" / "default_model"
FACT = {"Where": r" {name} lives in (\w+)\.", "job?": r" {name} works as an? (\w+)\.",
        "code?": r" {name}'s locker code is (\d+)\."}


def test_supervised_tokens_are_the_replies_and_copy_the_notes() -> None:
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    prompts = [make_prompt(STAGES[1].extra[0][0], "train", i) for i in range(2)]
    rows = [encode(tokenizer, p, all_questions=True) + ([KINDS.index(qa.kind) for qa in p.qas], True) for p in prompts]
    batch = collate(rows, 64)
    width = batch.ids.shape[1]
    assert (batch.ids.reshape(-1)[batch.positions + 1] == batch.targets).all()  # each position predicts the next token
    for b, p in enumerate(prompts):
        mine = batch.positions // width == b
        answers = batch.answer[mine]
        for a, qa in zip(sorted(set(answers.tolist())), p.qas):
            reply = tokenizer.decode(batch.targets[mine][answers == a].tolist(), skip_special_tokens=False)
            assert reply == f"Answer: {qa.answer}<|im_end|>"
            key = "Where" if qa.question.startswith("Where") else qa.question.split()[-1]
            name = qa.question.split()[2].removesuffix("'s")
            stated = re.findall(FACT[key].format(name=name), " ".join(p.notes))
            assert stated == [qa.answer]  # the fact about the asked name, stated once, holds the gold answer
            value = batch.targets[mine][answers == a].tolist()[2:-1]  # between "Answer", ":" and <|im_end|>
            context = rows[b][0][: rows[b][1][0][0]]
            assert any(context[i: i + len(value)] == value for i in range(len(context)))  # the same tokens as the note
        # supervised tokens are the replies and nothing else: as many as the replies have
        assert mine.sum() == sum(len(tokenizer.encode(f"Answer: {qa.answer}<|im_end|>", add_special_tokens=False).ids)
                                 for qa in p.qas)
