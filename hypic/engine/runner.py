"""Runs one scheduled batch through the model and returns the logits of the sampling tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hypic.cache.model_caches import ModelCaches
from hypic.engine.batch_builder import build_forward_batch
from hypic.cache.segment_store import SegmentStore
from hypic.engine.cuda_graphs import DecodeGraphs
from hypic.engine.pic_step import Capture, PicStep, build_assembly, build_capture
from hypic.engine.scheduler import ScheduledBatch
from hypic.kernels.linear_families import LinearFamily


@dataclass(frozen=True)
class RunnerSettings:
    block_size: int
    max_num_seqs: int
    max_model_len: int
    tokenizer_vocab_size: int  # logits past it (embedding padding) are never sampled
    use_cuda_graphs: bool


class ModelRunner:
    def __init__(self, model: torch.nn.Module, caches: ModelCaches, settings: RunnerSettings,
                 *, scratch_slot: int, scratch_block: int, store: SegmentStore, family: LinearFamily) -> None:
        self.model, self.caches, self.settings = model, caches, settings
        self.store, self.family = store, family
        self.device = caches.kv_device
        self.graphs: DecodeGraphs | None = None
        if settings.use_cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(
                model, caches, max_num_seqs=settings.max_num_seqs,
                max_blocks=-(-settings.max_model_len // settings.block_size),
                scratch_slot=scratch_slot, scratch_block=scratch_block,
                max_kv_len=settings.max_model_len)

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, Capture | None]:
        """Logits [M, V] (float32) of the chunks that sample, in chunk order, and the tuples
        captured from the step's cold segments."""
        forward = build_forward_batch(batch, self.settings.block_size, self.device)
        forward.pic = self._pic_step(batch, forward.seq_lens_cpu, forward.num_decodes)
        if self.graphs is not None and self.graphs.can_run(forward):
            logits = self.graphs.run(forward)
        else:
            logits = self.model.compute_logits(self.model(forward, self.caches))
        logits[:, self.settings.tokenizer_vocab_size:] = float("-inf")
        return logits, forward.pic.capture if forward.pic is not None else None

    def _pic_step(self, batch: ScheduledBatch, seq_lens: tuple[int, ...], num_decodes: int) -> PicStep | None:
        width = self.caches.shape.conv_kernel
        assembly = build_assembly(batch.chunks, seq_lens, num_decodes, width, self.device)
        capture = build_capture(batch.chunks, seq_lens, width, self.device)
        if assembly is None and capture is None:
            return None
        layout = self.store.layout
        return PicStep(self.family, assembly, capture, self.store.t_src, self.store.s0_src,
                       layout.t_layer_stride, layout.s0_layer_stride)
