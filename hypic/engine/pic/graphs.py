"""CUDA graphs of the assembly step: the one step of a warm PIC request that composes its cached
pieces and walks its seam and query tokens. Launched eagerly it spends far longer on the host
(~1400 kernel launches for a 40-layer model) than on the GPU, and it is most of the request's
time to first token.

A graph is captured per token count of a ladder and number of requests it holds (SLOTS), with
room for MAX_PIECES cached pieces a request. The assemblies of a step run together in the
smallest one with room for them and one more token (the step's decodes in their own graph,
engine/runner.py): one replay reads the MoE's expert weights once for all of them, where one
replay each would read them each time. Request slots the step leaves empty hold a one-token
dummy, and a padding sequence takes the other rows, all in the scratch slot and page (each walks
its tokens, then composes the store's zero tuple once, so it is walked like a request; MoE blocks
route the padding's rows to no expert, so they load no expert weights). Token tensors have the
captured shape; piece tables fill a leading part of theirs, and the piece pointers keep the
kernels inside it.

Short prefills (a new turn after a prefix checkpoint, a short prompt) ride in the same graphs:
walked token by token as a request composing nothing, they take no chunked kernel, and eagerly
their step was host-bound as an assembly's was (~58 ms for 15 tokens on Qwen3.5-35B-A3B).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from hypic.cache.model_caches import ModelCaches
from hypic.cache.segment_store import SegmentStore
from hypic.engine.batch_builder import TENSOR_FIELDS, build_step
from hypic.engine.cuda_graphs import capture_graph
from hypic.engine.pic.pieces import Cached, Chunk, walk_length
from hypic.engine.pic.state import PicState
from hypic.engine.scheduler import ScheduledBatch, ScheduledChunk
from hypic.models.batch import ForwardBatch

# Steps of at most a quarter past 128 tokens (a warm step's seams and question: 384 tokens pad to 448,
# not 512): a padding row still costs the dense layers (the MoE skips it), while a graph more costs
# only a warm-up and a capture at start, in the memory pool all sizes share.
SIZES = (32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
MAX_PIECES = 32  # cached pieces of a request; one with more runs eagerly
# requests one replay holds; a graph of n holds at least 32 tokens a request (a warm chunk's seams and
# question); a step of more assemblies, or of more tokens than a graph holds, replays several
SLOTS = (1, 2, 4)
# A step that would replay more runs as one eager forward. Each replay reads the MoE's experts again, and
# on the H200 (Qwen3.5-35B-A3B, Fig. 11's 12k-token prompts) the graphs' steps were faster than eager
# ones at every rate up to ~30 req/s (p50 TTFT 44 against 97 ms at 7), where a step holds a few
# assemblies, and slower at saturation (23.5 against 29.1 req/s), where one holds tens of them; with
# this limit it saturates at 25.8.
MAX_REPLAYS = 4


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
        self.shapes = tuple((size, n) for n in SLOTS for size in sizes if 32 * n <= size <= max_tokens)
        self.use_graphs = use_graphs
        self.static: dict[tuple[int, int], ForwardBatch] = {}  # by (tokens, requests)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for shape in sorted(self.shapes, reverse=True):
            # sized for the longest KV range: attention picks its KV splits from it, not from the capture
            # batch; the padding sequence's rows (from its first one, read at each replay) skip the MoE
            built = self._build(self._capture_batch(*shape))
            forward = dataclasses.replace(built, max_kv_len=self.max_kv_len, in_graph=True,
                                          valid_tokens=built.cu_seqlens[-2:-1])
            self.static[shape] = forward
            self.logits[shape] = self._forward(forward)  # warm-up outside the graph (compiles, autotunes)
            if self.use_graphs:
                self.graphs[shape], self.logits[shape] = capture_graph(functools.partial(self._forward, forward), pool)
        if self.use_graphs:
            torch.cuda.synchronize()

    def padded(self, chunks: Sequence[ScheduledChunk]) -> list[ScheduledBatch] | None:
        """Assembly chunks whose tokens are all walked and short prefills (walked too), in as few
        padded steps as graphs hold them (all in one, else each half in its own, and so on); None if
        a chunk fits no graph or they would take more than MAX_REPLAYS."""
        if not self.static or not all(self._fits(c) for c in chunks):
            return None
        batches = self._split(list(chunks))
        return batches if batches is not None and len(batches) <= MAX_REPLAYS else None

    def _split(self, chunks: list[ScheduledChunk]) -> list[ScheduledBatch] | None:
        one = self._padded_group(chunks) if len(chunks) <= SLOTS[-1] else None
        if one is not None or len(chunks) == 1:
            return None if one is None else [one]
        first, second = self._split(chunks[:len(chunks) // 2]), self._split(chunks[len(chunks) // 2:])
        return None if first is None or second is None else first + second

    def _fits(self, scheduled: ScheduledChunk) -> bool:
        """An assembly chunk walked whole, or a short prefill (walked like an assembly's short tail)."""
        chunk = scheduled.chunk
        if scheduled.seq.pic.job is not None or len(scheduled.seq.block_ids) > self.max_blocks:
            return False
        if not chunk.cached:
            return scheduled.short_prefill
        return len(chunk.cached) <= MAX_PIECES and walk_length(chunk) == chunk.num_tokens

    def _padded_group(self, group: list[ScheduledChunk]) -> ScheduledBatch | None:
        """The group, a one-token dummy in each request slot it leaves empty, and the padding."""
        slots = next(n for n in SLOTS if n >= len(group))
        dummies = [self._padding(1, 1, 0, samples=False) for _ in range(slots - len(group))]
        tokens = sum(c.chunk.num_tokens for c in group) + len(dummies)
        size = min((s for s, n in self.static if n == slots and s > tokens), default=None)
        if size is None:
            return None
        walked = [c if c.chunk.cached else dataclasses.replace(c, walked=True) for c in group]
        return ScheduledBatch([*walked, *dummies, self._padding(size - tokens, 1, 0, samples=False)])

    def run(self, forward: ForwardBatch) -> torch.Tensor:
        """Logits of the sampling rows of a padded step (its requests')."""
        shape = forward.num_tokens, forward.num_seqs - 1
        static = self.static[shape]
        for name in TENSOR_FIELDS:
            copy_into(getattr(static, name), getattr(forward, name))
        _copy_fields(static.pic.assembly, forward.pic.assembly)
        if self.use_graphs:
            self.graphs[shape].replay()
            logits = self.logits[shape]
        else:  # the torch references also read host lengths, which on the GPU only size grids
            logits = self._forward(_with_host_lengths(static, forward))
        return logits[:forward.logits_indices.shape[0]]

    def _forward(self, forward: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(forward, self.caches))

    def _build(self, batch: ScheduledBatch) -> ForwardBatch:
        return build_step(batch, self.caches.block_size, self.store, self.caches.kv_device)

    def _capture_batch(self, size: int, slots: int) -> ScheduledBatch:
        """`slots` padding sequences shaped like a request (samples, widest block table, MAX_PIECES
        pieces) and the padding (one piece)."""
        share = size // (slots + 1)
        requests = [self._padding(share, MAX_PIECES, self.max_blocks, samples=True) for _ in range(slots)]
        return ScheduledBatch([*requests, self._padding(size - slots * share, 1, 0, samples=False)])

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
            copy_into(getattr(static, field.name), value)
        elif dataclasses.is_dataclass(value):
            _copy_fields(getattr(static, field.name), value)


def copy_into(static: torch.Tensor, built: torch.Tensor) -> None:
    """The built tensor into the leading corner of the captured one (block tables are narrower,
    piece tables shorter, a step that does not sample has no logits row); the rest keeps earlier
    values, all in bounds, that no sequence reads."""
    static[tuple(slice(0, n) for n in built.shape)].copy_(built, non_blocking=True)
