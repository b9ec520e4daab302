"""The linear-mixer protocol: what a linear-attention layer tells the engine and does for PIC.

A mixer (Gated DeltaNet, Mamba2, ...) projects its inputs, runs a causal conv1d over some of them,
turns the conv output into the operands of its linear family's recurrence (`Operands`: q, k, v, g,
beta in the family's conventions), recurs, and produces its output. It names its family and its
state and conv shapes (`LinearShape`). Everything else is shared: `forward` runs the ordinary
kernels or, when the step does PIC work, the per-layer PIC operations of `hypic.kernels.pic_layer`
over the inputs the engine built (`hypic.models.batch.PicStep`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from hypic.cache.model_caches import LinearShape
from hypic.kernels import pic_layer
from hypic.kernels.conv1d import causal_conv1d
from hypic.kernels.varlen import Operands, StateSpans
from hypic.models.batch import Assembly, ForwardBatch, PicStep


class LinearMixer(nn.Module, ABC):
    """Subclasses set `shape` (its family included) and `scale` (of q in o_t = S_t^T (scale q_t))
    and implement the four steps below; `recur` defaults to the family's chunked varlen path."""

    shape: LinearShape
    scale: float
    conv_activation = "silu"

    @abstractmethod
    def conv_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight [conv_dim, W] and bias [conv_dim] (or None) of the conv over `project`'s conv input."""

    @abstractmethod
    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(conv input [N, conv_dim], what `operands` and `output` need besides it)."""

    @abstractmethod
    def operands(self, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> Operands:
        """The family's recurrence operands from the conv output (activation applied)."""

    @abstractmethod
    def output(self, o: torch.Tensor, conv_out: torch.Tensor, side: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The layer's output [N, hidden] from the recurrence output o [N, HV, V]."""

    @abstractmethod
    def fused_decode(self, conv_in: torch.Tensor, side: tuple[torch.Tensor, ...], ssm_pool: torch.Tensor,
                     conv_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """A decode-only step without PIC work (what a CUDA graph replays): conv, operands, recurrence and
        the output norm in the family's few fused kernels; the layer's output [N, hidden]."""

    def recur(self, x: Operands, ssm_pool: torch.Tensor, spans: StateSpans) -> torch.Tensor:
        """The recurrence over spans from their slots' states (written back); o [N, HV, V]."""
        return self.shape.family.recur_spans(x, ssm_pool, spans, scale=self.scale)

    def conv(self, conv_in: torch.Tensor, conv_pool: torch.Tensor, spans: StateSpans) -> torch.Tensor:
        """Causal conv1d + activation per span, reading and updating each span's window in conv_pool."""
        weight, bias = self.conv_weights()
        return causal_conv1d(conv_in, weight, bias, conv_pool, spans.slots, spans.has_state, spans.cu_seqlens,
                             num_decodes=spans.num_decodes, seq_lens_cpu=spans.seq_lens,
                             activation=self.conv_activation)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, ssm_pool: torch.Tensor,
                conv_pool: torch.Tensor, linear_index: int) -> torch.Tensor:
        if batch.plain_decode:
            return self.fused_decode(*self.project(hidden), ssm_pool, conv_pool, batch)
        return self.shared_path(hidden, batch, ssm_pool, conv_pool, linear_index)

    def shared_path(self, hidden: torch.Tensor, batch: ForwardBatch, ssm_pool: torch.Tensor,
                    conv_pool: torch.Tensor, linear_index: int) -> torch.Tensor:
        """Every family's step as separate kernels: prefill, mixed batches and the PIC operations."""
        conv_in, side = self.project(hidden)
        pic = batch.pic
        assembly = None if pic is None else pic.assembly
        if assembly is None:
            conv_out = self.conv(conv_in, conv_pool, batch.spans)
        else:
            conv_out = self._spliced_conv(conv_in, conv_pool, batch, pic, linear_index)
        x = self.operands(conv_out, side)
        if batch.sequence_padding is not None:
            x = x.inert_outside(batch.sequence_padding.real)
            self._window_from_real_rows(conv_in, conv_pool, batch)
        if pic is not None and pic.capture is not None:
            self._capture(pic, conv_in, x, linear_index)
        if assembly is None:
            o = self.recur(x, ssm_pool, batch.spans)
        else:
            o = self._assembled(x, ssm_pool, assembly, pic, linear_index)
        return self.output(o, conv_out, side)

    def _spliced_conv(self, conv_in: torch.Tensor, conv_pool: torch.Tensor, batch: ForwardBatch, pic: PicStep,
                      linear_index: int) -> torch.Tensor:
        a = pic.assembly
        weight, bias = self.conv_weights()
        tails = pic.store.conv_tails(a.tail_offsets, linear_index)
        return pic_layer.spliced_conv(conv_in, tails, a.conv_index, a.conv_keep, weight, bias, conv_pool,
                                      a.conv_spans(batch), a.saves, a.save_conv_rows, self.conv_activation)

    def _assembled(self, x: Operands, ssm_pool: torch.Tensor, a: Assembly, pic: PicStep,
                   linear_index: int) -> torch.Tensor:
        store = pic.store
        return pic_layer.assembled_recurrence(
            x, ssm_pool, family=self.shape.family, scale=self.scale, walk=a.walk, walk_rows=a.walk_rows,
            walks_every_row=a.walks_every_row, pieces=store.layer_pieces(a.pieces, linear_index),
            t_src=store.t_src(linear_index), s0_src=store.s0_src, saves=a.saves, rest=a.rest, rest_rows=a.rest_rows,
            chunked=self.recur)

    def _window_from_real_rows(self, conv_in: torch.Tensor, conv_pool: torch.Tensor, batch: ForwardBatch) -> None:
        """The last sequence's conv window: its last W-1 real inputs, not the padding's after them."""
        conv_pool[batch.slots[-1:]] = conv_in[batch.sequence_padding.window_rows].T[None].to(conv_pool.dtype)

    def _capture(self, pic: PicStep, conv_in: torch.Tensor, x: Operands, linear_index: int) -> None:
        c = pic.capture
        if c.keep is not None:
            x = x.inert_outside(c.keep)
        T, S0 = pic_layer.segment_tuple(self.shape.family, x, c.spans, c.identity_T, c.layer_priors(linear_index))
        c.add_linear(linear_index, T, S0, conv_in)
