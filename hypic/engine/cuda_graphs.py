"""CUDA graphs of the decode step, one per batch size of a ladder, replayed with padded inputs."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from hypic.cache.model_caches import ModelCaches
from hypic.kernels.varlen import graph_capture
from hypic.models.batch import ForwardBatch

_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)


def capture_graph(run: Callable[[], torch.Tensor], pool: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run` captured into a CUDA graph in memory pool `pool` (after a warm-up the caller ran outside
    it: compiles, autotunes), and the tensor it returns, which each replay rewrites."""
    graph = torch.cuda.CUDAGraph()
    with graph_capture(), torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class DecodeGraphs:
    """Padding rows use a scratch slot and a scratch page that no sequence owns."""

    def __init__(self, model: torch.nn.Module, caches: ModelCaches, *, max_num_seqs: int,
                 max_blocks: int, scratch_slot: int, scratch_block: int, max_kv_len: int,
                 use_graphs: bool = True) -> None:
        """`use_graphs=False` runs the padded step eagerly (CPU tests of steps that replay graphs)."""
        self.model, self.caches, self.max_kv_len, self.use_graphs = model, caches, max_kv_len, use_graphs
        self.sizes = tuple(s for s in _LADDER if s < max_num_seqs) + (max_num_seqs,)
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.max_blocks, self.block_size = max_blocks, caches.block_size
        self.static = self._static_inputs(max(self.sizes), caches.kv_device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.ready = False  # captured (or, without graphs, warmed up)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for size in sorted(self.sizes, reverse=True):
            self._pad_from(0, size)
            batch = self._graph_batch(size)
            self._forward(batch)  # warm-up outside the graph (compiles and autotunes kernels)
            if not self.use_graphs:
                continue
            self.graphs[size], self.logits[size] = capture_graph(functools.partial(self._forward, batch), pool)
        self.ready = True
        if self.use_graphs:
            torch.cuda.synchronize()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.plain_decode and batch.num_seqs <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks and self.ready)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        s = self.static
        for name in ("input_ids", "positions", "slots", "kv_lens", "kv_write_slots"):
            s[name][:n].copy_(getattr(batch, name), non_blocking=True)
        s["block_tables"][:n, : batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        self._pad_from(n, size)
        if not self.use_graphs:  # the torch references read the host's KV lengths too
            padded = dataclasses.replace(self._graph_batch(size), kv_lens_cpu=(*batch.kv_lens_cpu, *(1,) * (size - n)))
            return self._forward(padded)[:n]
        self.graphs[size].replay()
        return self.logits[size][:n]

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(batch, self.caches))

    def _static_inputs(self, size: int, device: torch.device) -> dict[str, torch.Tensor]:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)
        return {"input_ids": zeros(size), "positions": zeros(size), "slots": zeros(size),
                "kv_lens": zeros(size, dtype=torch.int32), "kv_write_slots": zeros(size),
                "block_tables": zeros(size, self.max_blocks, dtype=torch.int32),
                "has_state": torch.ones(size, dtype=torch.bool, device=device),
                "cu_seqlens": torch.arange(size + 1, dtype=torch.int32, device=device),
                "logits_indices": torch.arange(size, device=device)}

    def _pad_from(self, start: int, end: int) -> None:
        """Rows [start, end) decode a dummy token into the scratch slot and page."""
        if start == end:  # a batch the size of its graph: no padding rows
            return
        s = self.static
        s["input_ids"][start:end] = 0
        s["positions"][start:end] = 0
        s["slots"][start:end] = self.scratch_slot
        s["kv_lens"][start:end] = 1
        s["kv_write_slots"][start:end] = self.scratch_block * self.block_size
        s["block_tables"][start:end] = self.scratch_block

    def _graph_batch(self, size: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(
            input_ids=s["input_ids"][:size], positions=s["positions"][:size],
            cu_seqlens=s["cu_seqlens"][: size + 1], slots=s["slots"][:size],
            has_state=s["has_state"][:size], block_tables=s["block_tables"][:size],
            kv_lens=s["kv_lens"][:size], kv_write_slots=s["kv_write_slots"][:size],
            logits_indices=s["logits_indices"][:size], num_decodes=size,
            seq_lens_cpu=(1,) * size, kv_lens_cpu=(1,) * size, max_kv_len=self.max_kv_len, in_graph=True)
