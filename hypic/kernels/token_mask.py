"""A grammar's token bitmask onto rows of the logits, in place: forbidden tokens become -inf.

words[s] is a packed mask (bit t of word w allows token 32w + t, llguidance's layout); pairs[i] is
(a logits row, the words row it takes). CUDA: one Triton pass that writes only the
forbidden logits (a [32, 248k] unpack in torch was five kernels and ~200 MB of traffic). CPU: torch,
through a byte lookup table (2.5x faster there than shifting every bit out).
"""
from __future__ import annotations

from typing import Any

import torch

from hypic.kernels.triton_lazy import triton_kernel

tl: Any  # triton.language, bound by triton_lazy on first GPU use

_BLOCK = 2048
_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [256, 8]: the bits of a byte, lowest first
_CEILING = torch.where(_BITS == 1, float("inf"), float("-inf"))  # min(logit, ceiling) masks a logit


def apply_token_mask(logits: torch.Tensor, pairs: torch.Tensor, words: torch.Tensor) -> None:
    """logits [M, V] (a row stride of its own allowed); pairs [k, 2] int32 and words [S, ceil(V/32)]
    int32, both on the logits' device."""
    if pairs.shape[0] == 0:
        return
    if logits.device.type != "cuda":
        apply_token_mask_ref(logits, pairs, words)
        return
    apply_token_mask_triton(logits, pairs, words)


def warm_up(device: torch.device, vocab: int) -> None:
    """On CUDA, compiles the kernel now rather than on a server's first constrained token: the integer
    arguments Triton specialises on are the vocabulary's, whatever the batch."""
    if device.type == "cuda":
        words = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32, device=device)
        logits = torch.zeros((1, words.shape[1] * 32), device=device)[:, :vocab]
        apply_token_mask_triton(logits, torch.zeros((1, 2), dtype=torch.int32, device=device), words)


def apply_token_mask_ref(logits: torch.Tensor, pairs: torch.Tensor, words: torch.Tensor) -> None:
    vocab = logits.shape[1]
    ceilings = _CEILING.to(logits.dtype)[words.view(torch.uint8).int()].view(len(words), -1)[:, :vocab]
    for row, source in pairs.tolist():
        torch.minimum(logits[row], ceilings[source], out=logits[row])


def apply_token_mask_triton(logits: torch.Tensor, pairs: torch.Tensor, words: torch.Tensor) -> None:
    vocab = logits.shape[1]
    grid = (pairs.shape[0], -(-vocab // _BLOCK))
    _token_mask_kernel[grid](logits, logits.stride(0), pairs, words, vocab, words.shape[1], BLOCK=_BLOCK)


@triton_kernel
def _token_mask_kernel(logits, stride, pairs, words, vocab, num_words, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(pairs + 2 * i).to(tl.int64)
    source = tl.load(pairs + 2 * i + 1).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < vocab
    word = tl.load(words + source * num_words + t // 32, mask=inside, other=-1)
    forbidden = ((word >> (t % 32)) & 1) == 0
    minus_inf = tl.full([BLOCK], float("-inf"), logits.dtype.element_ty)
    tl.store(logits + row * stride + t, minus_inf, mask=inside & forbidden)
