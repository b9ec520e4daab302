"""Runs one scheduled batch through the model and returns the logits of the sampling tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hypic.cache.model_caches import ModelCaches
from hypic.engine.batch_builder import build_forward_batch
from hypic.engine.cuda_graphs import DecodeGraphs
from hypic.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class RunnerSettings:
    block_size: int
    max_num_seqs: int
    max_model_len: int
    tokenizer_vocab_size: int  # logits past it (embedding padding) are never sampled
    use_cuda_graphs: bool


class ModelRunner:
    def __init__(self, model: torch.nn.Module, caches: ModelCaches, settings: RunnerSettings,
                 *, scratch_slot: int, scratch_block: int) -> None:
        self.model, self.caches, self.settings = model, caches, settings
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
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [M, V] (float32) of the chunks that sample, in chunk order."""
        forward = build_forward_batch(batch, self.settings.block_size, self.device)
        if self.graphs is not None and self.graphs.can_run(forward):
            logits = self.graphs.run(forward)
        else:
            logits = self.model.compute_logits(self.model(forward, self.caches))
        logits[:, self.settings.tokenizer_vocab_size:] = float("-inf")
        return logits
