"""Random varlen batches and float64 oracles shared by the kernel tests."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Varlen:
    """A flat batch: decodes (one token each) first, then prefill sequences."""

    seq_lens: tuple[int, ...]
    num_decodes: int
    slots: torch.Tensor  # [B] int64, distinct
    has_state: torch.Tensor  # [B] bool

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor(self.starts, dtype=torch.int32)

    @property
    def starts(self) -> list[int]:
        return list(itertools.accumulate(self.seq_lens, initial=0))

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


def make_varlen(prefill_lens: tuple[int, ...], num_decodes: int, num_slots: int, gen: torch.Generator,
                fresh: tuple[int, ...] = ()) -> Varlen:
    """Sequences `fresh` (indices) start from a zero state; decodes always have state."""
    lens = (1,) * num_decodes + prefill_lens
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)]
    has_state = torch.tensor([b not in fresh for b in range(len(lens))])
    return Varlen(lens, num_decodes, slots, has_state)


def gdn_recurrence_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token float64 gated delta rule of one sequence. q, k [T, H, K]; v [T, HV, V];
    state [HV, K, V]. Value head hv reads key head hv // (HV // H)."""
    ratio = v.shape[1] // q.shape[1]
    s = state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        for hv in range(v.shape[1]):
            kt, qt = k[t, hv // ratio].double(), q[t, hv // ratio].double()
            a, b = g[t, hv].double().exp(), beta[t, hv].double()
            s[hv] = a * (s[hv] - b * torch.outer(kt, kt @ s[hv])) + b * torch.outer(kt, v[t, hv].double())
        outs.append(torch.einsum("hkv,hk->hv", s, torch.stack(
            [q[t, hv // ratio].double() for hv in range(v.shape[1])]) * scale))
    return torch.stack(outs), s
