"""Synthetic multi-note question answering: the data the bundled model is trained and measured on."""
from __future__ import annotations

from hypic.data.tasks import (
    EVAL_SPEC,
    EVAL_SPEC_SINGLE_NAMES,
    KINDS,
    SPLITS,
    NotePool,
    Prompt,
    QA,
    TaskSpec,
    eval_prompts,
    extract_answer,
    is_correct,
    make_prompt,
    make_prompts,
)

__all__ = ["EVAL_SPEC", "EVAL_SPEC_SINGLE_NAMES", "KINDS", "SPLITS", "NotePool", "Prompt", "QA", "TaskSpec",
           "eval_prompts", "extract_answer", "is_correct", "make_prompt", "make_prompts"]
