"""Continuous batching: each step is one flat batch of decode tokens and prefill chunks.

Decodes go first (one token each), then running short or warm prefills, then newly admitted
requests, then long prefills and cold segment jobs, all under one token budget; a step that
assembles warm requests or walks short prefills leaves the long ones to the next (at most
LONG_WAITS steps in a row). While anything else
is in flight, the long ones together cost at most `long_prefill_token_threshold` a step (counted by
`PrefillCost`: a chunk deep in its context counts its attention), so a step that holds one stays
near a decode step's time (and one cold job captures in such a step); alone they take the whole
budget. Cold jobs also stay within the capture
workspace the memory plan leaves free: at most `capture_jobs` capture in a step, and one starts a
partial tuple only while fewer than `partial_jobs` are kept (`hypic.cache.memory_plan`). While a
job's chunk runs on the cold lane (`PicState.on_lane`, `hypic.engine.pic.cold_lane`) no job is
scheduled and that one is never preempted. Admission is fair between requests: waiting sequences are taken round-robin over
their admission groups (a client's batch is one group). A queued sequence's turn is one past the
turn being served or its group's last queued turn, whichever is later; turns are admitted in
order (queue order within one), so a batch of many prompts never holds back a request that came
after it, and a flood of new requests never starves a batch's next prompt. Memory is taken per chunk; when pages run out the scheduler evicts prefix-cache
checkpoints, then preempts the newest running sequence (it is recomputed later).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from hypic.cache.block_pool import BlockPool, NoFreeBlocks
from hypic.cache.memory_plan import CAPTURE_JOBS, PARTIAL_JOBS
from hypic.cache.model_caches import ModelCaches
from hypic.cache.prefix_cache import PrefixCache, accepted_provenances, share_pages
from hypic.cache.slot_pool import SlotPool
from hypic.engine.pic.pieces import TAIL_WALK_MAX, Chunk, walk_length
from hypic.engine.prefill_cost import PrefillCost
from hypic.engine.sequence import Sequence, SequenceStatus


# Steps in a row a long prefill or cold job may wait for warm ones: on an H200 a step of an assembly and a
# cold chunk (two graphs, each reading every MoE expert) took ~60 ms against ~30 for either alone, and
# warm requests arrive in runs under load; the jobs still move at least every third step.
LONG_WAITS = 2


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    chunk: Chunk
    checkpoint_slot: int | None = None  # receives the state before the chunk's last token (a checkpoint)
    # walked token by token though it composes nothing: a short prefill in an assembly graph
    # (hypic.engine.pic.graphs), whose walk needs no chunked kernel (which no graph holds)
    walked: bool = False

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last logits pick the next token."""
        return self.chunk.end == len(self.seq.token_ids) and self.seq.pic.job is None

    @property
    def short_prefill(self) -> bool:
        """Up to TAIL_WALK_MAX tokens of a request's prompt composing nothing, not a decode: the assembly
        graphs walk it as they walk an assembly's short tail (hypic.engine.pic.graphs)."""
        chunk = self.chunk
        return (not chunk.cached and self.seq.pic.job is None and not self.runs_as_decode
                and 0 < chunk.num_tokens <= TAIL_WALK_MAX)

    @property
    def runs_as_decode(self) -> bool:
        """One sampled token after computed state, nothing composed: exactly a decode step, so a
        prompt resumed from its last-token checkpoint runs with the decodes (and their graphs)."""
        chunk = self.chunk
        return (chunk.num_tokens == 1 and chunk.start > 0 and not chunk.cached and self.samples
                and self.checkpoint_slot is None)


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first
    num_decodes: int = 0
    admitted: list[Sequence] = field(default_factory=list)  # got a slot and pages this step

    @property
    def num_tokens(self) -> int:
        return sum(c.chunk.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    long_prefill_cost: int = 0  # EngineConfig.long_prefill_token_threshold, resolved; 0: no cap
    capture_jobs: int = CAPTURE_JOBS  # cold jobs capturing interior rows in one step
    partial_jobs: int = PARTIAL_JOBS  # cold jobs kept part-captured between steps


@dataclass
class StepBudget:
    """What is left of one step's budgets while it is scheduled."""

    tokens: int  # of max_num_batched_tokens
    long_cost: float  # of the long-prefill cost cap (math.inf: none this step)
    long_started: bool = False  # a long chunk is in the step
    capture_jobs: int = 0  # cold jobs that may still capture interior rows this step
    partial_jobs: int = 0  # cold jobs that may still start a partial tuple this step


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockPool, slots: SlotPool,
                 prefix: PrefixCache, caches: ModelCaches, cost: PrefillCost) -> None:
        self.limits, self.blocks, self.slots, self.prefix, self.caches = limits, blocks, slots, prefix, caches
        self.cost = cost  # what a long chunk costs against the cap (measured from the steps)
        self._min_long_tokens = max(1, caches.shape.conv_kernel - 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # since start (a counter for /metrics)
        self._turn = 0  # the admission turn being served (see the module's docstring)
        self._long_waits = 0  # steps in a row that left the long prefills and cold jobs to the next

    def add(self, seq: Sequence, *, first: bool = False) -> None:
        """`first`: ahead of everything (a segment prefill its request waits for, a preempted sequence)."""
        if first:
            self.waiting.appendleft(seq)
            return
        group = seq.info.admission_group
        queued = [s.admission_turn for s in self.waiting if s.info.admission_group == group]
        seq.admission_turn = max([self._turn, *queued]) + 1
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        partial = sum(s.pic.captured is not None for s in self.running)
        cap = self._long_prefill_cap()
        # beside other work, one cold job a step: on a GPU each job's chunk replays a graph of its own,
        # which reads every MoE expert, so a second one would double the step the cap bounds; none
        # while one runs on the cold lane (its captures have not landed, and the cold graphs' buffers
        # are the lane's until they do)
        lane_busy = any(s.pic.on_lane for s in self.running)
        jobs = 0 if lane_busy else self.limits.capture_jobs if cap == math.inf else 1
        batch, budget = ScheduledBatch(), StepBudget(self.limits.max_num_batched_tokens, cap, capture_jobs=jobs,
                                                     partial_jobs=self.limits.partial_jobs - partial)
        for seq in [s for s in self.running if s.in_decode]:
            if budget.tokens > 0 and seq in self.running and self._reserve(seq, seq.num_computed + 1, batch):
                batch.chunks.append(ScheduledChunk(seq, seq.next_chunk(1)))
                budget.tokens -= 1
        prefills = [s for s in self.running if not s.in_decode and not (lane_busy and s.pic.job is not None)]
        self._schedule_prefills([s for s in prefills if not self._long(s)], budget, batch)
        # long prefills and cold segment jobs after every short or warm one, admitted ones too: a
        # warm request never waits behind a cold chunk
        long_ready = [s for s in prefills if self._long(s)] + self._admit_waiting(batch, budget, jobs=False)
        if not self._defers_long(batch, long_ready):
            self._schedule_prefills(long_ready, budget, batch)
            self._admit_waiting(batch, budget, jobs=True)
        batch.chunks.sort(key=lambda c: not c.runs_as_decode)  # stable: decodes first, in order
        batch.num_decodes = sum(c.runs_as_decode for c in batch.chunks)
        return batch

    def _defers_long(self, batch: ScheduledBatch, long_ready: list[Sequence]) -> bool:
        """Whether the long prefills and cold jobs wait for the next step: this one assembles warm
        requests or walks short prefills (which then run in CUDA graphs beside the decodes' graph; a
        long chunk, another graph of its own or an eager forward, would hold those requests' first
        tokens for it) and they did not wait in the last LONG_WAITS steps."""
        defer = self._long_waits < LONG_WAITS and any(c.chunk.cached or c.short_prefill for c in batch.chunks) and (
            bool(long_ready) or any(s.pic.job is not None and not s.pic.blocked for s in self.waiting))
        self._long_waits = self._long_waits + 1 if defer else 0
        return defer

    def _schedule_prefills(self, seqs: list[Sequence], budget: StepBudget, batch: ScheduledBatch) -> None:
        for seq in seqs:
            if seq in self.running:  # not preempted by an earlier one's memory
                self._schedule_prefill(seq, budget, batch)

    def _admit_waiting(self, batch: ScheduledBatch, budget: StepBudget, *, jobs: bool) -> list[Sequence]:
        """Admits waiting sequences (cold segment jobs or the rest) in admission order while the
        step has room, scheduling each one's chunk; returns the long ones, whose chunks wait for
        the step's short ones (only `jobs=False` returns any)."""
        deferred = []
        for seq in self._admission_order(jobs):
            full = budget.tokens <= 0 or (jobs and budget.capture_jobs <= 0)
            if full or len(self.running) >= self.limits.max_num_seqs or not self._admit(seq):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            batch.admitted.append(seq)
            self._turn = max(self._turn, seq.admission_turn)
            if self._long(seq) and not jobs:
                deferred.append(seq)
            else:
                self._schedule_prefill(seq, budget, batch)
        return deferred

    def _long(self, seq: Sequence) -> bool:
        """A cold segment job, or a prefill with no cached piece left to compose and more tokens to
        go than the long-prefill threshold: what the long-prefill cap holds back beside others."""
        threshold = self.limits.long_prefill_cost or math.inf
        return seq.pic.job is not None or (not seq.pic.cached and seq.remaining > threshold)

    def _long_prefill_cap(self) -> float:
        """This step's cost cap on long prefills: the threshold while anything they would hold up is
        in flight (a decode, a short or warm prefill, a short request waiting that no job blocks), else
        none: a lone long prompt is not held up by itself."""
        if not self.limits.long_prefill_cost:
            return math.inf  # no cap configured: no need to look at the queues
        others = any(not self._long(s) for s in self.running) or any(
            not s.pic.blocked and not self._long(s) for s in self.waiting)  # a job is long
        return self.limits.long_prefill_cost if others else math.inf

    def finish(self, seq: Sequence, reason: str, *, checkpoint: bool = True) -> None:
        """Free a sequence's memory, keeping a checkpoint of everything it computed (unless not
        `checkpoint`: its step failed, leaving its state slot half-written)."""
        if checkpoint and seq.status is SequenceStatus.RUNNING and seq.num_computed > 0:
            self._checkpoint(seq, seq.num_computed)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and keep the checkpoints this step reached."""
        for scheduled in batch.chunks:
            seq, end = scheduled.seq, scheduled.chunk.end
            seq.num_computed = end
            seq.pic.computed_to(end)
            if end in seq.checkpoints:
                self._checkpoint(seq, end)
            if scheduled.checkpoint_slot is not None:
                self._checkpoint(seq, end - 1, scheduled.checkpoint_slot)
                self.slots.release(scheduled.checkpoint_slot)

    def drop_step(self, batch: ScheduledBatch) -> None:
        """A step whose forward failed (`after_step` never runs): the slots it took for checkpoints
        go back empty."""
        for scheduled in batch.chunks:
            if scheduled.checkpoint_slot is not None:
                self.slots.release(scheduled.checkpoint_slot)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` a copy of `parent`'s cache (n > 1 completions share one prefill)."""
        child.slot = self._take_slot()
        if child.slot is None:
            return False
        self.caches.copy_slot(parent.slot, child.slot)
        try:
            child.block_ids = share_pages(self.blocks, self.caches, parent.block_ids, parent.num_computed,
                                          self.limits.block_size)
        except NoFreeBlocks:
            self._free(child)
            return False
        child.num_computed, child.status = parent.num_computed, SequenceStatus.RUNNING
        self.running.append(child)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_seats(self) -> int:
        """Sequences that can still start running (of max_num_seqs)."""
        return max(0, self.limits.max_num_seqs - len(self.running))

    def admission_queue(self) -> list[Sequence]:
        """The waiting sequences of requests (no cold segment jobs), blocked ones too, in the order
        admission takes them: the first ones are those the next steps admit."""
        return _in_turn([s for s in self.waiting if s.pic.job is None])

    def _admission_order(self, jobs: bool) -> list[Sequence]:
        """Unblocked waiting cold segment jobs (or the rest) in turn. Filtered before the sort: each
        of a step's two admission passes sorts only its own part of the queue."""
        return _in_turn([s for s in self.waiting if not s.pic.blocked and (s.pic.job is not None) == jobs])

    # -- prefill chunks ------------------------------------------------------------------------

    def _schedule_prefill(self, seq: Sequence, budget: StepBudget, batch: ScheduledBatch) -> None:
        if budget.tokens <= 0:
            return
        chunk = seq.next_chunk(self._chunk_tokens(seq, budget))
        if not chunk.token_ids and seq.pic.job is None and self._reserve(seq, seq.num_computed + 1, batch):
            chunk = seq.next_chunk(self._chunk_tokens(seq, budget))  # memory freed for at least one token
        captures, partial = _capture_kind(seq, chunk)
        if not self._within_capture(captures, partial, budget):
            return
        if not chunk.token_ids or not self._reserve(seq, chunk.end, batch):
            return
        if seq.info.first_scheduled_time is None:
            seq.info.first_scheduled_time = time.monotonic()
        scheduled = self._through_last_checkpoint(seq, chunk, budget.tokens, batch) or ScheduledChunk(seq, chunk)
        batch.chunks.append(scheduled)
        budget.tokens -= scheduled.chunk.num_tokens
        budget.capture_jobs -= captures
        budget.partial_jobs += partial
        if self._long(seq):
            budget.long_cost -= self.cost.cost(chunk.start, chunk.num_tokens)
            budget.long_started = True

    def _chunk_tokens(self, seq: Sequence, budget: StepBudget) -> int:
        """What the step's budgets leave `seq`: tokens, memory and, for a long prefill, its cost cap."""
        tokens = min(budget.tokens, self._fitting_tokens(seq))
        if self._long(seq):
            tokens = min(tokens, self._long_tokens(seq, budget))
        return tokens if seq.pic.job is None else self._job_tokens(seq, tokens)

    def _long_tokens(self, seq: Sequence, budget: StepBudget) -> int:
        """Tokens from `seq`'s position within the long-prefill cost left this step; the step's first
        long chunk always moves (at least W-1 tokens: a job's conv-tail chunk fits)."""
        if budget.long_cost == math.inf:
            return budget.tokens
        tokens = self.cost.tokens_within(seq.num_computed, budget.long_cost)
        return tokens if budget.long_started else max(tokens, self._min_long_tokens)

    def _through_last_checkpoint(self, seq: Sequence, chunk: Chunk, budget: int,
                                 batch: ScheduledBatch) -> ScheduledChunk | None:
        """An assembly chunk cut at the checkpoint one token before the prompt's end also runs that
        token when its walk can keep the state there (in a slot of its own): one step, not two."""
        end = len(seq.token_ids)
        if chunk.end != end - 1 or not chunk.cached or end - 1 not in seq.checkpoints:
            return None
        longer = seq.next_chunk(budget, through_checkpoints=True)
        if longer.end != end or walk_length(longer) != longer.num_tokens:
            return None
        if not self._reserve(seq, end, batch) or (slot := self._take_slot()) is None:
            return None  # pages reserved for the last token stay with seq: its next step needs them
        return ScheduledChunk(seq, longer, slot)

    def _job_tokens(self, seq: Sequence, tokens: int) -> int:
        """A cold job runs to its interior's end, never cutting inside the interior's last W-1 tokens:
        its conv tail is taken from the one chunk that holds them."""
        start, end = seq.num_computed, seq.pic.job.interior[1]
        stop, tail_start = min(end, start + tokens), end - self.caches.shape.conv_kernel + 1
        return max(0, (tail_start if tail_start < stop < end else stop) - start)

    @staticmethod
    def _within_capture(captures: bool, partial: int, budget: StepBudget) -> bool:
        """Whether a chunk (`_capture_kind`) keeps the step within its capture bounds
        (`SchedulerLimits`); if not, no job captures more this step: it waits for the next, and the
        jobs behind it are not admitted only to wait in seats."""
        if captures and (budget.capture_jobs <= 0 or budget.partial_jobs + partial < 0):
            budget.capture_jobs = 0
            return False
        return True

    def _fitting_tokens(self, seq: Sequence) -> int:
        capacity = (len(seq.block_ids) + self.blocks.num_free) * self.limits.block_size
        return max(0, capacity - seq.num_computed)

    # -- memory ------------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, end: int, batch: ScheduledBatch) -> bool:
        """Pages for tokens [0, end) of `seq`; evicts checkpoints, then preempts newer sequences."""
        need = -(-end // self.limits.block_size) - len(seq.block_ids)
        while need > self.blocks.num_free:
            if self.prefix.evict_one():
                continue
            victim = self._preemption_victim(seq, batch)
            if victim is None:
                return False
            self._preempt(victim)
        if need > 0:
            seq.block_ids.extend(self.blocks.allocate(need))
        return True

    def _preemption_victim(self, seq: Sequence, batch: ScheduledBatch) -> Sequence | None:
        scheduled = {id(c.seq) for c in batch.chunks}
        candidates = [s for s in reversed(self.running)  # a job on the lane is still writing its pages
                      if s is not seq and id(s) not in scheduled and not s.pic.on_lane]
        return candidates[0] if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self._free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence) -> bool:
        seq.slot = self._take_slot()
        if seq.slot is None:
            return False
        seq.status = SequenceStatus.RUNNING
        seq.checkpoints = self._checkpoint_positions(seq)
        self._attach_prefix_hit(seq)
        hit_tokens = seq.pic.hit_tokens  # what the prefix hit left
        if hit_tokens and seq.info.first_scheduled_time is None:
            seq.info.cached_tokens_by_kind.update(hit_tokens)
        while self._fitting_tokens(seq) == 0 and self.prefix.evict_one():
            pass  # checkpoints may hold every free page: make room for at least one token
        if self._fitting_tokens(seq) == 0 or not self._take_pages(seq, seq.pic.scattered_end):
            self._free(seq)
            seq.num_computed, seq.status = 0, SequenceStatus.WAITING
            return False
        return True

    def _take_pages(self, seq: Sequence, end: int) -> bool:
        """Pages for positions [0, end) without preempting anyone (admission never preempts)."""
        need = -(-end // self.limits.block_size) - len(seq.block_ids)
        while need > self.blocks.num_free:
            if not self.prefix.evict_one():
                return False
        if need > 0:
            seq.block_ids.extend(self.blocks.allocate(need))
        return True

    def _take_slot(self) -> int | None:
        while self.slots.num_free == 0:
            if not self.prefix.evict_one():
                return None
        return self.slots.allocate()

    def _attach_prefix_hit(self, seq: Sequence) -> None:
        accept = accepted_provenances(seq.info.cache_mode, seq.info.seam_width)
        if not accept or seq.pic.job is not None:
            return
        # A hit may end before, at or past a cached interior (a conversation's next turn resumes
        # after its documents), never inside one.
        hit = self.prefix.lookup(seq.token_bytes(len(seq.token_ids)), seq.info.cache_salt, accept,
                                 not_inside=seq.pic.interiors)
        if hit is None:
            return
        try:
            seq.block_ids = self.prefix.attach(hit)
        except NoFreeBlocks:
            self.prefix.release(hit)
            return
        self.caches.copy_slot(hit.state_slot, seq.slot)
        self.prefix.release(hit)
        seq.num_computed = hit.num_tokens
        seq.pic.cover(hit.num_tokens)  # the PIC side unpins what it covers
        if seq.info.first_scheduled_time is None:  # counted once, not again after a preemption
            seq.info.cached_tokens_by_kind["prefix"] = hit.num_tokens

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_ids)
        if seq.slot is not None:
            self.slots.release(seq.slot)
        seq.block_ids, seq.slot = [], None

    # -- prefix checkpoints --------------------------------------------------------------------

    def _checkpoint_positions(self, seq: Sequence) -> list[int]:
        """End of the first segment (a shared system prompt) and the last prompt token but one (an
        identical prompt repeated then computes one token, as a CUDA-graph decode step), never
        inside a cached interior. A short first segment of an assembling prompt is not kept: cut
        there, it would run as an eager step of its own before the assembly step, which costs
        more than walking its tokens again in the next prompt's assembly."""
        if seq.info.cache_mode == "none" or seq.pic.job is not None:
            return []
        prompt_len = len(seq.info.prompt_ids)
        first_end = seq.info.segment_ends[0] if len(seq.info.segment_ends) > 1 else 0
        walked_with_assembly = seq.pic.cached and first_end <= TAIL_WALK_MAX
        marks = {0 if walked_with_assembly else first_end, prompt_len - 1}
        return sorted(m for m in marks if 0 < m < prompt_len and not any(a < m <= b for a, b in seq.pic.interiors))

    def _checkpoint(self, seq: Sequence, length: int, state_slot: int | None = None) -> None:
        """Keep the state after `length` tokens: seq's own slot unless the step left it in `state_slot`."""
        if seq.info.cache_mode != "none" and seq.pic.job is None:
            self.prefix.insert(seq.token_bytes(length), seq.info.cache_salt, seq.provenance(length),
                               seq.block_ids, seq.slot if state_slot is None else state_slot)


def _capture_kind(seq: Sequence, chunk: Chunk) -> tuple[bool, int]:
    """Whether a cold job's chunk holds interior rows (captures), and how it changes the partial
    tuples kept: -1 when it leaves the interior unfinished with none before (one kept until its next
    chunk), +1 when it finishes one kept from an earlier step, else 0. (False, 0) for any other chunk."""
    if seq.pic.job is None:
        return False, 0
    start, end = seq.pic.job.interior
    captures = max(chunk.start, start) < min(chunk.end, end)  # an empty chunk captures nothing
    kept, ends = seq.pic.captured is not None, chunk.end >= end
    return captures, int(captures and kept and ends) - int(captures and not kept and not ends)


def _in_turn(waiting: list[Sequence]) -> list[Sequence]:
    """Waiting sequences by turn (every group's first, then every group's second, ...), in queue
    order within a turn (what was put first stays first)."""
    return [waiting[i] for i in sorted(range(len(waiting)), key=lambda i: (waiting[i].admission_turn, i))]
