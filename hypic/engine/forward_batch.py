"""The one structure the runner hands to the model each step: a flat varlen batch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hypic.engine.pic.step import PicStep


@dataclass
class ForwardBatch:
    """A step's tokens, flattened. Sequences are ordered decodes first, then prefill chunks.

    Invariant: a token's position equals its KV index in its sequence, so full attention masks
    by position (key index <= query position) over the sequence's pages.
    """

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, global position of each token
    cu_seqlens: torch.Tensor  # [B+1] int32, token offsets of each sequence in this step
    slots: torch.Tensor  # [B] int64, state-slab slot of each sequence
    has_state: torch.Tensor  # [B] bool, False: the sequence starts from a zero state (its first chunk)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    kv_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    kv_write_slots: torch.Tensor  # [N] int64, block_id * block_size + offset where each token's K/V goes
    logits_indices: torch.Tensor  # [M] int64, indices into N whose hidden states come back
    num_decodes: int  # the first num_decodes sequences have exactly one token each
    seq_lens_cpu: tuple[int, ...]  # [B] tokens of each sequence in this step (host copy)
    max_kv_len: int  # max(kv_lens), host copy
    pic: PicStep | None = None  # PIC assembly and cold-segment capture of this step, if any

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs
