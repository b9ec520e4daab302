"""CUDA graphs of a cold segment's chunk: the step of decodes and one cold job's chunk that a cold
document brings under load. Launched eagerly it is one forward bound by the host (75-160 ms on
Qwen3.5-35B-A3B: every layer's chunked kernels and their autotuner look-ups) for GPU work of a
fraction of that, and every warm request that arrives meanwhile waits for it. Here the decodes
replay their graph and the chunk one of these, captured per padded token count (beside other work,
on the cold lane: hypic.engine.pic.cold_lane).

The padding rows continue the job's own sequence (`ForwardBatch.sequence_padding`), so the chunked
kernels see one span of the captured length whatever the chunk's: linear layers make those rows
inert (T = I, no input) and keep the job's conv window from its last real rows, full layers write
their K/V to the scratch page, MoE blocks route them to no expert. The tuple is taken over every
row with the rows outside the interior made inert (`Capture.keep`) and composed after the job's
tuple so far, from static buffers (the identity before its first chunk: exact); the host copies
it out after the replay. Naive jobs (T = I stored) and models whose attention splits a chunk by
its host length (`prefill_graphs`) stay eager, and so do families whose kernels were not checked
in graphs on a GPU (`LinearFamily.prefill_graphs`: the Mamba2 family's failed its check).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from hypic.cache.model_caches import ModelCaches
from hypic.cache.segment_store import SegmentLayout, SegmentStore, TupleStaging
from hypic.engine.batch_builder import build_forward_batch
from hypic.engine.cuda_graphs import capture_graph
from hypic.engine.pic.graphs import copy_into
from hypic.engine.pic.step import interior_rows
from hypic.engine.scheduler import ScheduledBatch, ScheduledChunk
from hypic.kernels.host_copy import host_to_device_packed
from hypic.kernels.varlen import RowSpans
from hypic.models.batch import Capture, ForwardBatch, PicStep, SequencePadding, TupleSoFar

# Under load a cold chunk stays within the long-prefill cap (512 tokens on a GPU) beside the decodes;
# a longer one runs when little else does, and its GPU time outweighs its launches.
SIZES = (64, 128, 192, 256, 384, 512, 768, 1024)
# A step of more cold chunks runs as one eager forward: each replay reads every MoE expert again (on the
# H200, Qwen3.5-35B-A3B, seven chunks of ~500 tokens replayed in 178 ms against 110 ms eagerly). Beside
# other work a step holds one (hypic.engine.scheduler); more come when cold jobs run alone.
MAX_REPLAYS = 2
_BATCH_FIELDS = ("input_ids", "positions", "kv_write_slots", "slots", "has_state", "block_tables", "kv_lens")


class ColdGraphs:
    def __init__(self, model: torch.nn.Module, caches: ModelCaches, store: SegmentStore, *, max_blocks: int,
                 scratch_slot: int, scratch_block: int, max_tokens: int, max_kv_len: int,
                 sizes: Sequence[int] = SIZES, use_graphs: bool = True) -> None:
        """Chunks of up to `max_tokens` tokens over up to `max_kv_len` keys; `use_graphs=False` runs the
        padded chunk eagerly (CPU tests of the padding)."""
        self.model, self.caches, self.store = model, caches, store
        self.max_blocks, self.scratch_slot, self.scratch_block = max_blocks, scratch_slot, scratch_block
        self.max_kv_len, self.use_graphs = max_kv_len, use_graphs
        self.sizes = tuple(s for s in sizes if s <= max_tokens)
        self.width = store.layout.conv_kernel
        device, bs = caches.kv_device, caches.block_size
        # one set for every size: a tuple so far is 120 MB on Qwen3.5-35B-A3B
        self.prior, self.out = self._tuple_buffers(), self._tuple_buffers()
        self.identity = self._identity_T()
        self.staging = TupleStaging(store.layout, 1, max(self.sizes, default=0), device)
        self.scratch_writes = scratch_block * bs + torch.arange(max(self.sizes, default=0), device=device) % bs
        self.static: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @staticmethod
    def holds(model: torch.nn.Module, layout: SegmentLayout) -> bool:
        """Whether a model's cold chunks can be captured: it has linear layers, of families whose kernels
        are checked in graphs (`LinearFamily.prefill_graphs`), none of its layers splits a chunk by its
        host length, and its chunked kernels are FLA's (a float32 model's prefills take their torch
        references, which read lengths back)."""
        families = bool(layout.linear) and all(s.family.prefill_graphs for s in layout.linear)
        return model.prefill_graphs and families and layout.model_dtype != torch.float32

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for size in sorted(self.sizes, reverse=True):
            forward = self.static[size] = self._static_batch(size)
            self.logits[size] = self._forward(forward)  # warm-up outside the graph (compiles, autotunes)
            if self.use_graphs:
                self.graphs[size], self.logits[size] = capture_graph(functools.partial(self._forward, forward), pool)
        if self.use_graphs:
            torch.cuda.synchronize()

    def takes(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether graphs hold a step's cold job chunks: at most MAX_REPLAYS, each one a graph holds."""
        return len(chunks) <= MAX_REPLAYS and all(self._holds(c) for c in chunks)

    def _holds(self, scheduled: ScheduledChunk) -> bool:
        """A chunk that captures interior rows, has the W-1 rows of a conv window, and whose job stores
        a real T."""
        job, chunk = scheduled.seq.pic.job, scheduled.chunk
        if not self.static or job is None or job.identity_T or interior_rows(job, chunk) is None:
            return False
        return self.width - 1 <= chunk.num_tokens <= self.sizes[-1] and len(scheduled.seq.block_ids) <= self.max_blocks

    def run(self, scheduled: ScheduledChunk, index: int) -> tuple[torch.Tensor, Capture]:
        """Replays the chunk's graph (its sequence `index` of its step); returns its logits rows (none:
        a job samples nothing) and its capture, as the eager step's would be."""
        built = build_forward_batch(ScheduledBatch([scheduled]), self.caches.block_size, self.caches.kv_device)
        n = built.num_tokens
        size = next(s for s in self.sizes if s >= n)
        static = self.static[size]
        for name in _BATCH_FIELDS:
            copy_into(getattr(static, name), getattr(built, name))
        static.kv_write_slots[n:].copy_(self.scratch_writes[n:size])  # never a real page, whatever ran before
        job, chunk = scheduled.seq.pic.job, scheduled.chunk
        start, end = (p - chunk.start for p in interior_rows(job, chunk))
        self._set_rows(static, n, start, end, job.interior[1] - chunk.start)
        prior = None if chunk.start <= job.interior[0] else scheduled.seq.pic.captured
        self._set_prior(prior)
        logits = self._replay(size, static, built)
        return logits, self._capture_view(static.pic.capture, index, prior, start, end,
                                          ends=chunk.end >= job.interior[1])

    def _set_rows(self, static: ForwardBatch, n: int, start: int, end: int, interior_end: int) -> None:
        """In one copy: which rows are real (the first `n`) and the conv window's (the last W-1 of them),
        which are the interior's, and the conv tail's (the interior's last W-1 rows, when the chunk
        holds them)."""
        rows = torch.arange(static.num_tokens)
        tail_end = interior_end if interior_end <= n else end
        host = [torch.tensor([n], dtype=torch.int32), rows < n, torch.arange(n - self.width + 1, n),
                (rows >= start) & (rows < end), torch.arange(tail_end - self.width + 1, tail_end).clamp(min=0)]
        moved = host_to_device_packed(host, self.caches.kv_device)
        padding, capture = static.sequence_padding, static.pic.capture
        targets = (static.valid_tokens, padding.real, padding.window_rows, capture.keep, capture.tail_rows[0])
        for dst, src in zip(targets, moved):
            dst.copy_(src, non_blocking=True)

    def _set_prior(self, prior: TupleSoFar | None) -> None:
        """The job's tuple so far into the static buffers; before its first chunk, the identity."""
        if prior is None:
            torch._foreach_copy_(self.prior.T, self.identity)
            torch._foreach_zero_(self.prior.S0)
        else:
            torch._foreach_copy_(self.prior.T, prior.T)
            torch._foreach_copy_(self.prior.S0, prior.S0)

    def _replay(self, size: int, static: ForwardBatch, built: ForwardBatch) -> torch.Tensor:
        if self.use_graphs:
            self.graphs[size].replay()
            return self.logits[size]
        # the torch references read host lengths too, which on the GPU only size grids
        return self._forward(dataclasses.replace(static, kv_lens_cpu=built.kv_lens_cpu, max_kv_len=built.max_kv_len))

    def _capture_view(self, capture: Capture, index: int, prior: TupleSoFar | None, start: int, end: int, *,
                      ends: bool) -> Capture:
        """The replay's capture as the eager step's: its job, its interior's rows and K/V, and (if the job
        goes on) its tuple so far, all copied out of the static buffers, which the next replay (of this
        step's next cold chunk too) overwrites. Only the host lengths of `spans` are read after a step."""
        going_on = [] if ends else [t[None].clone() for t in self.out.T]
        return dataclasses.replace(
            capture, jobs=(index,), priors=(prior,), ends=(ends,), staged=self.staging.rows(start, end, copy=True),
            spans=dataclasses.replace(capture.spans, starts=(start,), lens=(end - start,)),
            T=going_on, S0=[] if ends else [s[None].clone() for s in self.out.S0])

    def _forward(self, forward: ForwardBatch) -> torch.Tensor:
        forward.pic.capture.full_layers = 0  # a fresh capture's count, at every run
        return self.model.compute_logits(self.model(forward, self.caches))

    def _static_batch(self, size: int) -> ForwardBatch:
        """`size` rows of one sequence in the scratch slot and page, its capture over all of them."""
        device = self.caches.kv_device

        def long(*values: int) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)
        capture = Capture(jobs=(0,), identity_T=(False,), priors=(self.prior,), ends=(True,),
                          spans=RowSpans.build((0,), (size,), device), tail_rows=torch.zeros(
                              1, self.width - 1, dtype=torch.long, device=device),
                          staged=self.staging.rows(0, size), ending=None, going_on=None,
                          keep=torch.ones(size, dtype=torch.bool, device=device), out=self.out)
        return ForwardBatch(
            input_ids=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.arange(size, device=device), cu_seqlens=long(0, size).int(),
            slots=long(self.scratch_slot), has_state=torch.zeros(1, dtype=torch.bool, device=device),
            block_tables=torch.full((1, self.max_blocks), self.scratch_block, dtype=torch.int32, device=device),
            kv_lens=long(size).int(), kv_write_slots=self.scratch_writes[:size].clone(),
            logits_indices=long(), num_decodes=0, seq_lens_cpu=(size,), kv_lens_cpu=(size,),
            max_kv_len=self.max_kv_len, pic=PicStep(None, capture, self.store), in_graph=True,
            valid_tokens=long(size).int(), sequence_padding=SequencePadding(
                torch.ones(size, dtype=torch.bool, device=device), torch.arange(size - self.width + 1, size,
                                                                                device=device)))

    def _tuple_buffers(self) -> TupleSoFar:
        layout, device = self.store.layout, self.caches.kv_device
        return TupleSoFar([torch.zeros(layout.t_shape(i), device=device) for i in range(layout.num_linear)],
                          [torch.zeros(layout.s0_shape(i), device=device) for i in range(layout.num_linear)])

    def _identity_T(self) -> list[torch.Tensor]:
        """Each linear layer's stored form of T = I in float32 (one tensor per distinct shape)."""
        layout, device, by_shape = self.store.layout, self.caches.kv_device, {}
        for i, s in enumerate(layout.linear):
            by_shape.setdefault(layout.t_shape(i), s.family.identity_T(s.value_heads, s.key_dim, torch.float32,
                                                                       device))
        return [by_shape[layout.t_shape(i)] for i in range(layout.num_linear)]
