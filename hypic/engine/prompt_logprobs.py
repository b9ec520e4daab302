"""Prompt logprobs (completions' `echo` with `logprobs`, vLLM's `prompt_logprobs`).

Every prompt position's final hidden state comes back from the forward (as extra rows of
`logits_indices`) and is projected onto the vocabulary a bounded number of rows at a time, so a
long prompt never holds [L, V] logits: memory is ROWS_PER_CHUNK x V floats whatever its length.
The hidden state at position p scores prompt token p + 1; the first prompt token has no logprob.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hypic.kernels.host_copy import host_to_device, read_rows

ROWS_PER_CHUNK = 1024


@dataclass(frozen=True)
class PromptScoring:
    """The prompt tokens one step scores: the flat-batch row whose hidden state predicts each."""

    rows: tuple[int, ...]
    targets: tuple[int, ...]  # the prompt token after each row's position
    top_k: int  # alternatives per token (the largest any of the step's requests asks for)


@dataclass(frozen=True)
class PromptScores:
    logprobs: list[float]  # [P] of each target
    ranks: list[int]  # [P] 1 + how many tokens were likelier than the target
    top_ids: list[list[int]]  # [P, top_k] best first
    top_logprobs: list[list[float]]


def score_prompt_rows(hidden: torch.Tensor, scoring: PromptScoring, project: Callable[[torch.Tensor], torch.Tensor],
                      vocab_size: int, rows_per_chunk: int = ROWS_PER_CHUNK) -> PromptScores:
    """log_softmax of `project(hidden)` (logits past the tokenizer's `vocab_size` excluded) at each
    target and its top_k, one device-to-host copy at the end."""
    targets = host_to_device(list(scoring.targets), torch.long, hidden.device)
    chosen, ranks, values, ids = [], [], [], []
    for start in range(0, hidden.shape[0], rows_per_chunk):
        logprobs = torch.log_softmax(project(hidden[start:start + rows_per_chunk])[:, :vocab_size].float(), dim=-1)
        chosen.append(logprobs.gather(1, targets[start:start + rows_per_chunk, None]))
        ranks.append((logprobs > chosen[-1]).sum(dim=-1) + 1)
        top = logprobs.topk(scoring.top_k, dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    k = scoring.top_k
    table = read_rows([torch.cat(chosen), torch.cat(ranks)[:, None], torch.cat(values), torch.cat(ids)])
    return PromptScores([r[0] for r in table], [int(r[1]) for r in table], [[int(t) for t in r[2 + k:]] for r in table],
                        [r[2:2 + k] for r in table])
