"""What the engine hands the model each step: a flat varlen batch and, when the step does PIC work,
the inputs of that work (built on the host by `hypic.engine.pic.step`). The models own these types so
that nothing below the engine imports it.

Two kinds of PIC work ride in an ordinary step:
- assembly chunks: sequences whose chunk composes cached interiors. At each linear layer their
  recurrence runs through `compose_and_recur` (S <- T S + S0 at a piece, token recurrence between
  pieces) and each interior's conv tail is spliced into the conv input right where the interior
  sits, so the seam tokens after it see the interior's last k-1 pre-conv inputs (DESIGN §2).
- cold segments: isolated prefills whose interior inputs are captured at every layer; the tuple
  (T, S0, conv tail, pre-RoPE K and V) is built from them right there.
Sequences without pieces in the same step take the ordinary kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hypic.cache.segment_store import SegmentStore, TupleStaging
from hypic.kernels.compose import CachedPieces, StateCheckpoints
from hypic.kernels.varlen import RowSpans, StateSpans


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
    kv_lens_cpu: tuple[int, ...]  # [B] kv_lens, host copy
    max_kv_len: int  # max(kv_lens), host copy
    pic: PicStep | None = None  # PIC assembly and cold-segment capture of this step, if any
    # captured into a CUDA graph: the host copies above are the capture batch's, not each replay's, so
    # layers must not split the step by them (they may size grids); every length comes from the device
    in_graph: bool = False
    # [1] int32 on the device, rows from it on pad a captured step (never read back): MoE blocks route
    # them to no expert. None: every row is real
    valid_tokens: torch.Tensor | None = None
    # padding that continues the last sequence rather than being one of its own (a cold job's chunk in a
    # captured step); None: the padding, if any, is a sequence of its own
    sequence_padding: SequencePadding | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs

    @property
    def plain_decode(self) -> bool:
        """Decodes only, without PIC work: the step a CUDA graph replays, which layers run fused."""
        return self.is_decode_only and self.pic is None

    @property
    def spans(self) -> StateSpans:
        """The step's sequences as the linear kernels take them."""
        return StateSpans(self.slots, self.has_state, self.cu_seqlens, self.num_decodes, self.seq_lens_cpu)


@dataclass(frozen=True)
class SequencePadding:
    """Padding rows at the end of the step's last sequence: linear layers make them inert and keep that
    sequence's conv window from its last real rows, so its state is what its real rows leave. Both
    tensors are set once a step (a replay), not per layer."""

    real: torch.Tensor  # [N] bool: the rows that are not padding
    window_rows: torch.Tensor  # [W-1] int64: the sequence's last W-1 real rows, its conv window after the step


@dataclass
class Assembly:
    """The step's sequences that compose cached pieces, split at each one's last piece: the walk
    (tokens up to it, composed and recurred token by token) and the rest (the other sequences, then
    the tokens after each walk, which continue from the composed state through the mixer's ordinary
    chunked path)."""

    seqs: tuple[int, ...]  # the step's sequence index of each assembling sequence (host copy)
    walk: StateSpans  # the assembling sequences over their walk rows (no decodes)
    walk_rows: torch.Tensor  # [R] their walk tokens' rows in the flat batch, in order
    walks_every_row: bool  # walk_rows is every row of the step (a warm request alone): no gathers
    pieces: CachedPieces  # `at` indexes walk_rows; offsets of linear layer 0
    rest: StateSpans  # tails continue from the composed state in their slot
    rest_rows: torch.Tensor
    saves: StateCheckpoints  # per walking sequence: state before its last token (at -1: none), into a slot
    save_conv_rows: torch.Tensor  # [A, W-1] spliced conv rows before that token, into the same slot
    # (a sequence without a checkpoint rewrites its own slot with its last W-1 rows: no change)
    tail_offsets: torch.Tensor  # [P*(W-1)] int64: model_src offset of (piece, tap) at linear layer 0
    conv_index: torch.Tensor  # rows of cat([x, tails]) forming the spliced conv input
    conv_keep: torch.Tensor  # rows of the spliced conv output that belong to real tokens
    conv_cu_seqlens: torch.Tensor
    conv_lens: tuple[int, ...]

    def conv_spans(self, batch: ForwardBatch) -> StateSpans:
        """The step's sequences over the spliced conv input (same slots, longer spans)."""
        return StateSpans(batch.slots, batch.has_state, self.conv_cu_seqlens, batch.num_decodes, self.conv_lens)


@dataclass(frozen=True)
class TupleSoFar:
    """A cold segment's (T, S0) over the interior rows its earlier chunks held (float32), per linear
    layer: a long segment is prefilled chunk by chunk and its tuple composes exactly across them."""

    T: list[torch.Tensor]  # per linear layer [HV, *t_shape]
    S0: list[torch.Tensor]  # per linear layer [HV, K, V]


@dataclass
class Capture:
    """Cold segments of the step: where their interiors' rows in this step and conv tails sit in the
    flat batch, and their tuples captured layer by layer (composed after `priors`): the tuples of the
    jobs whose interior ends in this step straight into `staged`, in the pool's layout and dtypes; the
    others' (T, S0) in float32, to compose with their next chunk's."""

    jobs: tuple[int, ...]  # [J] the step's sequence index of each capturing job
    identity_T: tuple[bool, ...]  # [J] whether job j stores T = I (naive; only at its interior's end)
    priors: tuple[TupleSoFar | None, ...]  # [J] the tuple of the interior rows of job j's earlier chunks
    ends: tuple[bool, ...]  # [J] whether job j's interior ends in this step (its tuple is complete)
    spans: RowSpans  # [J] interior rows of each job in this step (consecutive rows of its chunk)
    tail_rows: torch.Tensor  # [E, W-1] rows of the pre-conv inputs just before each ending interior's end
    staged: TupleStaging  # the E ending jobs' tuples, in order; K/V of every job's interior rows
    ending: torch.Tensor | None  # [E] the ending jobs among the J (None: all of them)
    going_on: torch.Tensor | None  # [P] the other jobs among the J, whose next chunks compose after this one
    # per linear layer [P, HV, *t_shape] and [P, HV, K, V]: only the rows of the jobs going on (each keeps
    # its own until its next chunk), not the step's [J, ...]
    T: list[torch.Tensor] = field(default_factory=list)
    S0: list[torch.Tensor] = field(default_factory=list)
    full_layers: int = 0  # full layers captured so far
    # a captured step's (hypic.engine.pic.cold_graphs): `spans` cover all its rows and `keep` [N] bool says
    # which are the interior's (the others are made inert for the tuple); the tuple of its one job also
    # goes to `out`, static float32 buffers, for the host to keep if the job goes on
    keep: torch.Tensor | None = None
    out: TupleSoFar | None = None

    def add_linear(self, linear_index: int, T: torch.Tensor, S0: torch.Tensor, conv_in: torch.Tensor) -> None:
        """A linear layer's (T, S0) of every job (float32, composed after the priors) and its pre-conv
        input [N, conv_dim]: one copy per part for all the ending jobs."""
        st = self.staged
        st.part(0, linear_index).copy_(T if self.ending is None else T[self.ending])
        st.part(1, linear_index).copy_(S0 if self.ending is None else S0[self.ending])
        st.part(2, linear_index).copy_(conv_in[self.tail_rows].transpose(1, 2))
        if self.going_on is not None:
            self.T.append(T[self.going_on])
            self.S0.append(S0[self.going_on])
        if self.out is not None:
            self.out.T[linear_index].copy_(T[0])
            self.out.S0[linear_index].copy_(S0[0])

    def add_full(self, k_pre_rope: torch.Tensor, v: torch.Tensor | None) -> None:
        """A full layer's interior K (before RoPE) and V, gathered into the staging; v None: the K rows
        are the values too."""
        kv, rows = self.staged.kv, self.spans.rows
        for which, x in enumerate((k_pre_rope, v) if v is not None else (k_pre_rope,)):
            dst = kv[:, self.full_layers, which]
            torch.index_select(x.reshape(x.shape[0], *dst.shape[1:]), 0, rows, out=dst)
        self.full_layers += 1

    def layer_priors(self, linear_index: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Each job's (T, S0) so far at one linear layer (None: its interior starts in this step)."""
        return [None if p is None else (p.T[linear_index], p.S0[linear_index]) for p in self.priors]


@dataclass
class PicStep:
    """The PIC part of a step: what its linear and full layers compose and capture."""

    assembly: Assembly | None
    capture: Capture | None
    store: SegmentStore  # where the composed pieces' tuples and conv tails are read in place
