"""Runs one scheduled batch through the model and returns the logits of the sampling tokens."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hypic.cache.model_caches import ModelCaches
from hypic.cache.segment_store import SegmentStore
from hypic.engine.pic.cold_graphs import ColdGraphs
from hypic.engine.pic.cold_lane import ColdLane
from hypic.engine.pic.graphs import AssemblyGraphs
from hypic.engine.batch_builder import build_step
from hypic.engine.cuda_graphs import DecodeGraphs
from hypic.engine.prompt_logprobs import PromptScores, PromptScoring, score_prompt_rows
from hypic.engine.scheduler import ScheduledBatch, ScheduledChunk
from hypic.engine.step_parts import StepParts
from hypic.kernels.host_copy import host_to_device
from hypic.models.batch import Capture, ForwardBatch


@dataclass(frozen=True)
class GraphStep:
    """A step that graphs replay: the decodes' forward (None: no decodes), the warm assemblies and short
    prefills padded to assembly graphs, and the cold jobs' chunks (with their places in the step), one
    cold graph each, on the cold lane when there are others."""

    decodes: ForwardBatch | None
    assemblies: list[ScheduledBatch]
    cold: list[tuple[int, ScheduledChunk]]
    on_lane: bool


@dataclass(frozen=True)
class RunnerSettings:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    tokenizer_vocab_size: int  # logits past it (embedding padding) are never sampled
    use_cuda_graphs: bool


class ModelRunner:
    def __init__(self, model: torch.nn.Module, caches: ModelCaches, settings: RunnerSettings,
                 *, scratch_slot: int, scratch_block: int, store: SegmentStore) -> None:
        self.model, self.caches, self.settings = model, caches, settings
        self.store = store
        self.device = caches.kv_device
        self.graphs: DecodeGraphs | None = None
        self.assembly_graphs: AssemblyGraphs | None = None
        self.cold_graphs: ColdGraphs | None = None
        self.lane: ColdLane | None = None  # with cold graphs
        self.last_on_lane = False  # the last step's cold chunks run on the lane
        self.parts = StepParts(self.device)  # how the last step ran, and each part's times when the log wants them
        if settings.use_cuda_graphs and self.device.type == "cuda":
            max_blocks = -(-settings.max_model_len // settings.block_size)
            self.graphs = DecodeGraphs(
                model, caches, max_num_seqs=settings.max_num_seqs, max_blocks=max_blocks,
                scratch_slot=scratch_slot, scratch_block=scratch_block, max_kv_len=settings.max_model_len)
            shapes = dict(max_blocks=max_blocks, scratch_slot=scratch_slot, scratch_block=scratch_block,
                          max_tokens=min(settings.max_model_len, settings.max_num_batched_tokens),
                          max_kv_len=settings.max_model_len)
            self.assembly_graphs = AssemblyGraphs(model, caches, store, **shapes)
            if ColdGraphs.holds(model, store.layout):
                self.cold_graphs = ColdGraphs(model, caches, store, **shapes)
                self.lane = ColdLane(self.device)

    def capture_graphs(self) -> None:
        with torch.inference_mode():
            for graphs in (self.graphs, self.assembly_graphs, self.cold_graphs):
                if graphs is not None:
                    graphs.capture()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, scoring: PromptScoring | None = None, *, timed: bool = False
                ) -> tuple[torch.Tensor, list[Capture], PromptScores | None]:
        """Logits [M, V] (float32) of the chunks that sample, in chunk order, the captures of the step's
        cold segments (one a cold graph, one for an eager step), and the scores of the prompt tokens
        `scoring` names. `timed`: each part's times too (`parts`, for the debug log)."""
        self.parts.start_step(timed)
        parts = self._graph_parts(batch) if scoring is None else None
        self.last_on_lane = parts is not None and parts.on_lane
        scores = None
        if parts is not None:
            logits, captures = self._replay(parts, batch)
        else:
            forward = self._forward_batch(batch)
            logits, scores = self._one_forward(forward, scoring)
            captures = [] if forward.pic is None or forward.pic.capture is None else [forward.pic.capture]
        if logits.shape[1] > self.settings.tokenizer_vocab_size:  # embedding padding: never sampled
            logits[:, self.settings.tokenizer_vocab_size:] = float("-inf")
        return logits, captures, scores

    def _one_forward(self, forward: ForwardBatch, scoring: PromptScoring | None
                     ) -> tuple[torch.Tensor, PromptScores | None]:
        """The step as one forward: with prompt scores, in the decode graph, or eagerly."""
        if scoring is not None:
            with self.parts.part("eager, scoring prompt tokens"):
                return self._scored(forward, scoring)
        if self.graphs is not None and self.graphs.can_run(forward):
            with self.parts.part("decode graph"):
                return self.graphs.run(forward), None
        with self.parts.part("eager"):
            return self.model.compute_logits(self.model(forward, self.caches)), None

    @property
    def launched(self) -> str:
        """How the last step ran, for the engine's debug log: "eager", "decode graph + 2 assembly graphs"."""
        names = self.parts.names
        kinds = ("assembly graph", "cold graph", "lane cold graph")
        counted = [f"{n} {kind}{'s' if n > 1 else ''}" for kind in kinds if (n := names.count(kind))]
        return " + ".join([name for name in names if name not in kinds] + counted)

    def _graph_parts(self, batch: ScheduledBatch) -> GraphStep | None:
        """For a step of decodes, warm assemblies and short prefills that assembly graphs hold, and cold
        job chunks that cold graphs hold: its parts. Launched eagerly as one batch, such a step is bound
        by the host (~1400 launches an assembly, whatever its rows; 100-160 ms for a cold chunk beside
        decodes), so under load a warm request's first token took several times its graph's time.
        None for any other step."""
        if batch.num_decodes == len(batch.chunks):
            return None
        others = list(enumerate(batch.chunks))[batch.num_decodes:]
        cold = [(i, c) for i, c in others if c.seq.pic.job is not None]
        rest = [c for _, c in others if c.seq.pic.job is None]
        padded = [] if not rest or self.assembly_graphs is None else self.assembly_graphs.padded(rest)
        if (rest and not padded) or (cold and not self._cold_holds([c for _, c in cold])):
            return None
        on_lane = bool(cold) and self.lane is not None and bool(batch.num_decodes or padded)
        if not batch.num_decodes:
            return GraphStep(None, padded, cold, on_lane)
        decodes = self._forward_batch(ScheduledBatch(batch.chunks[:batch.num_decodes], batch.num_decodes))
        can_run = self.graphs is not None and self.graphs.can_run(decodes)
        return GraphStep(decodes, padded, cold, on_lane) if can_run else None

    def _cold_holds(self, chunks: list[ScheduledChunk]) -> bool:
        return self.cold_graphs is not None and self.cold_graphs.takes(chunks)

    def _replay(self, step: GraphStep, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Capture]]:
        """The sampling rows' logits in chunk order (the decodes' graph, then the assemblies'; cold
        chunks sample nothing) and the cold chunks' captures (none for chunks on the lane: the lane
        holds them). The assembly graphs share one memory pool, so a replay can overwrite the last
        one's logits: with several, each is copied out first. Cold chunks on the lane go first, so
        that they start at once beside the step's other graphs."""
        logits: list[torch.Tensor] = []
        if step.on_lane:
            with self.lane.chunks(batch, [c.seq for _, c in step.cold]) as held:
                lane_captures, cold_rows = self._replay_cold(step.cold, on_lane=True)
                held += lane_captures
            captures = []
        if step.decodes is not None:
            with self.parts.part("decode graph"):
                logits.append(self.graphs.run(step.decodes))
        for one in step.assemblies:
            with self.parts.part("assembly graph"):
                rows = self.assembly_graphs.run(self._forward_batch(one))
                logits.append(rows.clone() if len(step.assemblies) > 1 else rows)
        if not step.on_lane:
            captures, cold_rows = self._replay_cold(step.cold, on_lane=False)
        if not logits:  # a step of cold chunks alone: their (empty) rows
            logits.append(cold_rows)
        return (logits[0] if len(logits) == 1 else torch.cat(logits)), captures

    def _replay_cold(self, cold: list[tuple[int, ScheduledChunk]], *, on_lane: bool
                     ) -> tuple[list[Capture], torch.Tensor | None]:
        """The cold chunks' captures and the last one's (empty) logits rows."""
        captures, rows = [], None
        part = "lane cold graph" if on_lane else "cold graph"
        for index, scheduled in cold:
            with self.parts.part(part, waited=not on_lane):
                rows, capture = self.cold_graphs.run(scheduled, index)
            captures.append(capture)
        return captures, rows

    def step_stream(self) -> contextlib.AbstractContextManager:
        """Where an engine step runs: beside a cold lane, on its high-priority stream."""
        return self.lane.step() if self.lane is not None else contextlib.nullcontext()

    def land(self, *, wait: bool = False) -> tuple[ScheduledBatch, list[Capture]] | None:
        """The cold lane's step and captures once its chunks are done (`ColdLane.land`)."""
        return None if self.lane is None else self.lane.land(wait=wait)

    def join_lane(self) -> None:
        """The engine's later work waits for the lane's (a job dropped before it landed, a failed step)."""
        if self.lane is not None:
            self.lane.join()

    def _scored(self, forward: ForwardBatch, scoring: PromptScoring) -> tuple[torch.Tensor, PromptScores]:
        """An eager forward whose hidden states also come back at the scored prompt rows."""
        num_sampling = forward.logits_indices.shape[0]
        extra = host_to_device(list(scoring.rows), torch.long, self.device)
        forward.logits_indices = torch.cat([forward.logits_indices, extra])
        hidden = self.model(forward, self.caches)
        scores = score_prompt_rows(hidden[num_sampling:], scoring, self.model.compute_logits,
                                   self.settings.tokenizer_vocab_size)
        return self.model.compute_logits(hidden[:num_sampling]), scores

    def _forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        return build_step(batch, self.settings.block_size, self.store, self.device)
