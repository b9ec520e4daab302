"""Training batches for scripts/train_model.py: curriculum stages, tokenization, answer-only labels.

A batch is a function of (stage, seed, group): worker processes build groups of prompts, sort them
by length and cut them into padded batches of about `token_budget` tokens each.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from hypic.data.tasks import KINDS, Prompt, TaskSpec, make_prompt

PAD_ID = 0  # <|endoftext|>


@dataclass(frozen=True)
class Stage:
    spec: TaskSpec
    gate: float
    """Advance once the running exact match of every kind of this stage's answers reaches this."""
    until: float
    """... or once training time passes this fraction of the budget, whatever was learned."""


STAGES: tuple[Stage, ...] = (
    # Two or three short notes dense with facts, single-token names: the retrieval phase transition.
    Stage(TaskSpec(2, 3, 24, 64, (3.0, 1.0, 1.0, 1.0), rich_names=False, questions=8, facts_per_note=(2, 4)),
          gate=0.85, until=0.3),
    Stage(TaskSpec(2, 5, 32, 128, rich_names=False, questions=8, facts_per_note=(1, 4)), gate=0.85, until=0.45),
    Stage(TaskSpec(2, 6, 48, 160, rich_names=True, questions=6), gate=0.85, until=0.6),
    Stage(TaskSpec(3, 8, 64, 256, rich_names=True, questions=6), gate=0.9, until=1.0),
    Stage(TaskSpec(4, 12, 64, 512, rich_names=True, questions=4), gate=1.01, until=1.0),
)
REPLAY = 0.2
"""Share of prompts drawn from earlier stages, so later stages do not erase earlier skills."""


@dataclass
class Batch:
    ids: np.ndarray        # [B, T] int32, right padded
    positions: np.ndarray  # [N] int64 flat indices b * T + t whose logits predict a supervised token
    targets: np.ndarray    # [N] int64
    answer: np.ndarray     # [N] int64 answer index of each supervised token
    kinds: np.ndarray      # [A] int64 KINDS index per answer
    current: np.ndarray    # [A] bool: answer from the current stage (not replay)
    tokens: int            # real (unpadded) tokens


def encode(tokenizer: Tokenizer, prompt: Prompt, all_questions: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids (segments tokenized one by one, as hypic does) and (start, end) of each answer."""
    pieces = list(prompt.segments) + [text for text, _ in prompt.training_pieces()]
    supervised = [False] * len(prompt.segments) + [s for _, s in prompt.training_pieces()]
    if not all_questions:
        pieces, supervised = pieces[: len(prompt.segments) + 1], supervised[: len(prompt.segments) + 1]
    ids, spans = [], []
    for encoding, is_answer in zip(tokenizer.encode_batch(pieces, add_special_tokens=False), supervised):
        if is_answer:
            spans.append((len(ids), len(ids) + len(encoding.ids)))
        ids += encoding.ids
    return ids, spans


def collate(rows: list[tuple[list[int], list[tuple[int, int]], list[int], bool]], multiple: int) -> Batch:
    """rows: (ids, answer spans, answer kinds, is current stage). Pads to a multiple of `multiple`."""
    width = -(-max(len(r[0]) for r in rows) // multiple) * multiple
    ids = np.full((len(rows), width), PAD_ID, dtype=np.int32)
    positions, targets, answer, kinds, current = [], [], [], [], []
    for b, (row, spans, row_kinds, is_current) in enumerate(rows):
        ids[b, : len(row)] = row
        for (start, end), kind in zip(spans, row_kinds):
            positions += range(b * width + start - 1, b * width + end - 1)
            targets += row[start:end]
            answer += [len(kinds)] * (end - start)
            kinds.append(kind)
            current.append(is_current)
    return Batch(ids, np.array(positions), np.array(targets), np.array(answer), np.array(kinds),
                 np.array(current), sum(len(r[0]) for r in rows))


_TOKENIZER: Tokenizer | None = None


def init_worker(tokenizer_path: str) -> None:
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process: the pool is the parallelism
    _TOKENIZER = Tokenizer.from_file(tokenizer_path)


def make_group(stage: int, seed: int, group: int, token_budget: int, multiple: int,
               stages: tuple[Stage, ...] = STAGES) -> list[Batch]:
    """About four batches of `token_budget` padded tokens, built from length-sorted prompts."""
    rng = random.Random(f"train-group:{seed}:{stage}:{group}")
    rows, total = [], 0
    while total < 4 * token_budget:
        source = rng.randrange(stage) if stage and rng.random() < REPLAY else stage
        prompt = make_prompt(stages[source].spec, "train", rng.getrandbits(40), seed)
        ids, spans = encode(_TOKENIZER, prompt, all_questions=True)
        rows.append((ids, spans, [KINDS.index(qa.kind) for qa in prompt.qas], source == stage))
        total += len(ids)
    rows.sort(key=lambda r: len(r[0]))
    batches, start = [], 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and (end + 1 - start) * len(rows[end][0]) <= token_budget:
            end += 1
        batches.append(collate(rows[start:end], multiple))
        start = end
    rng.shuffle(batches)
    return batches
