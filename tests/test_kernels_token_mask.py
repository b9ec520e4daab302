"""The grammar-mask kernel (packed bitmask onto chosen rows of the logits, in place) against a
bit-by-bit reference: a subset of rows, rows sharing one mask, a padded row stride, a vocabulary
that is no multiple of 32, bf16 and float32. Triton on CUDA, or on the CPU through the interpreter."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.token_mask import apply_token_mask, apply_token_mask_ref, apply_token_mask_triton
from kernel_cases import interpreted


def bit_by_bit(logits: torch.Tensor, rows: list[int], sources: list[int], words: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for row, source in zip(rows, sources):
        for token in range(logits.shape[1]):
            if not (int(words[source, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


def case(dtype: torch.dtype) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    padded = torch.randn(5, 80, generator=gen).to(dtype)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    words[2] = -1  # every token allowed
    return padded[:, :70], [4, 0, 2], [1, 1, 0], words  # rows 4 and 0 share mask 1; rows 1 and 3 are free


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_bit_by_bit(dtype: torch.dtype) -> None:
    logits, rows, sources, words = case(dtype)
    expected = bit_by_bit(logits, rows, sources, words)
    apply_token_mask_ref(logits, torch.tensor(list(zip(rows, sources)), dtype=torch.int32), words)
    assert torch.equal(logits, expected)


def test_no_pairs_change_nothing() -> None:
    logits, _, _, words = case(torch.float32)
    before = logits.clone()
    apply_token_mask(logits, torch.as_tensor([], dtype=torch.int32), words[:0])  # what an empty host list becomes
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_bit_by_bit(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, rows, sources, words = case(dtype)
    expected = bit_by_bit(logits, rows, sources, words)
    on_device = logits.to(device)
    apply_token_mask_triton(on_device, torch.tensor(list(zip(rows, sources)), dtype=torch.int32, device=device),
                            words.to(device))
    assert torch.equal(on_device.cpu(), expected)
