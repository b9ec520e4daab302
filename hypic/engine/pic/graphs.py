"""CUDA graphs of the assembly step: the one step of a warm PIC request that composes its cached
pieces and walks its seam and query tokens. Launched eagerly it spends far longer on the host
(~1400 kernel launches for a 40-layer model) than on the GPU, and it is most of the request's
time to first token.

A graph is captured per token count of a ladder, with room for MAX_PIECES + 1 cached pieces. Each
assembly of a step runs in the smallest one with room for one more token (the step's decodes in
their own graph, engine/runner.py): a padding
sequence takes the other rows in the scratch slot and page (it walks its tokens, then composes the
store's zero tuple once, so it is walked like the request; MoE blocks route its rows to no expert,
so they load no expert weights). Token tensors have the captured shape; piece tables fill a
leading part of theirs, and the piece pointers keep the kernels inside it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hypic.cache.model_caches import ModelCaches
from hypic.cache.segment_store import SegmentStore
from hypic.engine.batch_builder import TENSOR_FIELDS, build_step
from hypic.engine.pic.pieces import Cached, Chunk, walk_length
from hypic.engine.pic.state import PicState
from hypic.engine.scheduler import ScheduledBatch, ScheduledChunk
from hypic.models.batch import ForwardBatch

# Steps of at most a quarter past 128 tokens (a warm step's seams and question: 384 tokens pad to 448,
# not 512): a padding row still costs the dense layers (the MoE skips it), while a graph more costs
# only a warm-up and a capture at start, in the memory pool all sizes share.
SIZES = (32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
MAX_PIECES = 32  # cached pieces of the request; one with more runs eagerly


@dataclasses.dataclass(frozen=True)
class _PaddingSequence:
    """What the batch builders read of a Sequence, for the padding rows."""

    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    slot: int
    pic: PicState = dataclasses.field(default_factory=PicState)


class AssemblyGraphs:
    def __init__(self, model: torch.nn.Module, caches: ModelCaches, store: SegmentStore,
                 *, max_blocks: int, scratch_slot: int, scratch_block: int, max_tokens: int, max_kv_len: int,
                 sizes: Sequence[int] = SIZES, use_graphs: bool = True) -> None:
        """Steps of up to `max_tokens` tokens (padding included) over up to `max_kv_len` keys can be
        captured; `use_graphs=False` runs the padded step eagerly (CPU tests of the padding)."""
        self.model, self.caches, self.store = model, caches, store
        self.max_blocks, self.scratch_slot, self.scratch_block = max_blocks, scratch_slot, scratch_block
        self.max_kv_len = max_kv_len
        self.sizes = tuple(s for s in sizes if s <= max_tokens)
        self.use_graphs = use_graphs
        self.static: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for size in sorted(self.sizes, reverse=True):
            # sized for the longest KV range: attention picks its KV splits from it, not from the capture
            # batch; the padding sequence's rows (from its first one, read at each replay) skip the MoE
            built = self._build(self._capture_batch(size))
            forward = dataclasses.replace(built, max_kv_len=self.max_kv_len, in_graph=True,
                                          valid_tokens=built.cu_seqlens[-2:-1])
            self.static[size] = forward
            self.logits[size] = self._forward(forward)  # warm-up outside the graph (compiles, autotunes)
            if self.use_graphs:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = self._forward(forward)
                self.graphs[size] = graph
        if self.use_graphs:
            torch.cuda.synchronize()

    def padded(self, scheduled: ScheduledChunk) -> ScheduledBatch | None:
        """An assembly chunk whose tokens are all walked, filled up to a captured size in a batch of
        its own, or None if no graph covers it."""
        chunk = scheduled.chunk
        if (not self.static or not chunk.cached or scheduled.seq.pic.job is not None or len(chunk.cached) > MAX_PIECES
                or walk_length(chunk) < chunk.num_tokens or len(scheduled.seq.block_ids) > self.max_blocks):
            return None
        size = next((s for s in self.sizes if s > chunk.num_tokens), None)
        if size is None:
            return None
        padding = self._padding(size - chunk.num_tokens, 1, 0, samples=False)
        return ScheduledBatch([scheduled, padding])

    def run(self, forward: ForwardBatch, num_samples: int) -> torch.Tensor:
        """Logits of the first `num_samples` (0 or 1) sampling rows of a padded step."""
        size = forward.num_tokens
        static = self.static[size]
        for name in TENSOR_FIELDS:
            _copy_into(getattr(static, name), getattr(forward, name))
        _copy_fields(static.pic.assembly, forward.pic.assembly)
        if self.use_graphs:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:  # the torch references also read host lengths, which on the GPU only size grids
            logits = self._forward(_with_host_lengths(static, forward))
        return logits[:num_samples]

    def _forward(self, forward: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(forward, self.caches))

    def _build(self, batch: ScheduledBatch) -> ForwardBatch:
        return build_step(batch, self.caches.block_size, self.store, self.caches.kv_device)

    def _capture_batch(self, size: int) -> ScheduledBatch:
        """Two padding sequences shaped like a request (samples, widest block table, MAX_PIECES
        pieces) and its padding (one piece)."""
        first = size // 2
        return ScheduledBatch([self._padding(first, MAX_PIECES, self.max_blocks, samples=True),
                               self._padding(size - first, 1, 0, samples=False)])

    def _padding(self, num_tokens: int, num_pieces: int, num_blocks: int, *, samples: bool) -> ScheduledChunk:
        """Tokens 0.. in the scratch slot and page, then `num_pieces` zero tuples composed."""
        zero = Cached(num_tokens, num_tokens, self.store.zero_entry, from_pool=False)
        chunk = Chunk(0, num_tokens, (0,) * num_tokens, tuple(range(num_tokens)), ((num_tokens, zero),) * num_pieces)
        pages = max(num_blocks, -(-num_tokens // self.caches.block_size))
        seq = _PaddingSequence((0,) * (num_tokens + (0 if samples else 1)), (self.scratch_block,) * pages,
                               self.scratch_slot)
        return ScheduledChunk(seq, chunk)


def _with_host_lengths(static: ForwardBatch, built: ForwardBatch) -> ForwardBatch:
    assembly = dataclasses.replace(static.pic.assembly, conv_lens=built.pic.assembly.conv_lens)
    return dataclasses.replace(static, seq_lens_cpu=built.seq_lens_cpu, kv_lens_cpu=built.kv_lens_cpu,
                               max_kv_len=built.max_kv_len,
                               pic=dataclasses.replace(static.pic, assembly=assembly))


def _copy_fields(static, built) -> None:
    """Every tensor of a (nested) dataclass into the captured one of the same structure."""
    for field in dataclasses.fields(built):
        value = getattr(built, field.name)
        if isinstance(value, torch.Tensor):
            _copy_into(getattr(static, field.name), value)
        elif dataclasses.is_dataclass(value):
            _copy_fields(getattr(static, field.name), value)


def _copy_into(static: torch.Tensor, built: torch.Tensor) -> None:
    """The built tensor into the leading corner of the captured one (block tables are narrower,
    piece tables shorter, a step that does not sample has no logits row); the rest keeps earlier
    values, all in bounds, that no sequence reads."""
    static[tuple(slice(0, n) for n in built.shape)].copy_(built, non_blocking=True)
