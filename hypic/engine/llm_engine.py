"""The synchronous engine core: add requests, step, collect outputs. AsyncEngine drives it."""
from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import xxhash

from hypic.cache.block_pool import BlockPool
from hypic.cache.memory_plan import CachePlan, CaptureWorkspace, plan_beside_capture
from hypic.cache.model_caches import ModelCaches
from hypic.cache.prefix_cache import PrefixCache, PrefixCacheStats
from hypic.cache.disk_tier import DiskStats
from hypic.cache.segment_store import SegmentKey, SegmentLayout, SegmentStore, SegmentStoreStats, SegmentTuple
from hypic.cache.slot_pool import SlotPool
from hypic.cache.tier_stats import TierStats
from hypic.config import CACHE_MODES, EngineConfig
from hypic.engine.pic.assembly import PicAssembler
from hypic.engine.pic.plan import SegmentJob
from hypic.engine.pic.read_cost import ReadOrRecompute, StepClock
from hypic.engine.prefill_cost import PrefillCost, StepWork, chunk_attention
from hypic.engine.prompt_logprobs import PromptScores, PromptScoring
from hypic.engine.request_state import Completion, RequestState
from hypic.engine.runner import ModelRunner, RunnerSettings
from hypic.engine.sampler import SampleResult, Sampler, SamplingRow, make_generator, validate_for_vocab
from hypic.engine.scheduler import ScheduledBatch, ScheduledChunk, Scheduler, SchedulerLimits
from hypic.engine.structured import PendingMasks, StructuredDecoding
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.sequence import RequestInfo, Sequence
from hypic.engine.setup import (build_lower_tiers, cache_budget_bytes, resolve_device, resolve_dtype,
                                resolve_long_prefill_threshold, resolve_model_dir, resolve_segment_state_dtype)
from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError, PromptTooLongError, StepOutOfMemoryError
from hypic.kernels.host_copy import host_to_device
from hypic.kernels.scatter_kv import rope_inv_freq
from hypic.models.registry import load_model
from hypic.outputs import CompletionDelta, RequestOutput, TokenLogprob
from hypic.sampling_params import SamplingParams

logger = logging.getLogger("hypic")

# Waiting requests past the free seats whose segments are looked up ahead: when a seat frees, the
# next request's promotions have landed; a few, since each holds its documents in the pool meanwhile.
ADMISSION_LOOKAHEAD = 2


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    state_slots_total: int
    state_slots_free: int
    prefix_cache: PrefixCacheStats
    segment_pool: SegmentStoreStats
    segment_host: TierStats | None  # None: no host tier
    segment_disk: DiskStats | None  # None: no disk tier
    requests_finished: int
    requests_aborted: int
    requests_failed: int  # their step ran out of device memory (StepOutOfMemoryError)
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    preemptions: int
    steps_out_of_memory: int  # steps whose forward ran out of device memory (their requests failed)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.model = load_model(str(self.model_dir), device=self.device, dtype=self.dtype,
                                state_dict=config.state_dict)
        self.model_config = self.model.config
        layout = self._segment_layout()
        self.plan, self.max_model_len, pool_bytes = self._plan_memory(layout)
        self._build_caches(self.plan, pool_bytes, layout)
        self.sampler = Sampler(self.tokenizer.vocab_size, self.tokenizer.token_text, seed=config.seed)
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.structured = StructuredDecoding(self.tokenizer.to_json(), self.tokenizer.vocab_size, self.eos_ids,
                                             self.device)
        self.requests: dict[str, RequestState] = {}
        self.last_step_ran = True  # False when the last step found nothing it could schedule
        self.steps = 0  # steps that ran a batch (how a watchdog sees the loop advance)
        self.counters = dict.fromkeys(("finished", "aborted", "failed", "prompt", "generated", "cached", "steps_oom"), 0)
        logger.info("hypic engine ready: %s on %s (%s), %s, max_model_len %d; %s", self.model_dir.name,
                    self.device, str(self.dtype).removeprefix("torch."), self.plan, self.max_model_len,
                    self._tier_capacities())

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: SegmentedPrompt, params: SamplingParams, *, request_id: str | None = None,
                    cache_salt: str | None = None, cache_mode: str | None = None,
                    resume: Mapping[int, list[int]] | None = None, group: str | None = None) -> str:
        """resume: completion index -> the ids it generated elsewhere (a node that died); only those
        completions run here, each continuing from its own tokens as if it had made them here.
        `group`: requests sharing one are admitted in turn with other groups' (a client's batch)."""
        request_id = request_id or uuid.uuid4().hex
        if len(prompt.segments) > 2 and not prompt.segments[-1]:
            params = dataclasses.replace(params, max_tokens=0)  # a warm-up: it only fills the caches
        info = self._request_info(prompt, params, request_id, cache_salt, cache_mode, group)
        _check_resume(resume or {}, params)
        state = self._request_state(info)
        self.requests[request_id] = state
        self.structured.add(request_id, params.structured)
        planned = self.pic.plan(prompt, info.cache_mode, cache_salt)
        for index, output_ids in (resume or {0: []}).items():
            seq = Sequence(info, index, output_ids)
            self._new_completion(state, seq)
            self.structured.replay(seq, output_ids)
            self.pic.queue(seq, planned)
            self.scheduler.add(seq)
        self._look_ahead()  # an engine with seats to spare starts its copies and cold jobs now
        self.counters["prompt"] += len(info.prompt_ids)
        return request_id

    # -- segments (PIC): for peers that prefill or pull segments for one another -------------------

    def segment_jobs(self, prompt: SegmentedPrompt, cache_salt: str | None = None,
                     cache_mode: str | None = None) -> list[SegmentJob]:
        """A prompt's PIC segments, each marked with the local store's best tier holding it (or None)."""
        planned = self.pic.plan(prompt, cache_mode or self.config.cache_mode, cache_salt)
        return [dataclasses.replace(p.job, tier=self.store.tier(p.job.key)) for p in planned]

    def start_segment_jobs(self, jobs: list[SegmentJob]) -> None:
        """Prefill (as cold child jobs) the segments that are neither stored nor under way."""
        for job in jobs:
            if job.key not in self.store and job.key not in self.pic.jobs:
                self.scheduler.add(self.pic.start_job(job), first=True)

    def fetch_segment(self, key: SegmentKey) -> None:
        """Start reading an entry only the disk tier holds, for a peer (`segment_pending` until done)."""
        self.pic.fetch(key)

    def segment_pending(self, key: SegmentKey) -> bool:
        """Being prefilled or read from disk here."""
        return key in self.pic.jobs or key in self.pic.fetching

    def export_segment(self, key: SegmentKey) -> SegmentTuple | None:
        return self.pic.export(key)

    def import_segment(self, key: SegmentKey, tup: SegmentTuple) -> bool:
        return self.store.put(key, tup)

    def flush_segments(self, salt: str | None = None) -> int:
        """Drops the public pool (or one salt's entries) and the prefix checkpoints with it."""
        self.prefix.clear(salt)
        return self.store.flush(salt)

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        return state.output(self._end(state, checkpoint=True))

    def _end(self, state: RequestState, *, checkpoint: bool, outcome: str = "aborted") -> list[CompletionDelta]:
        """Aborts a request's unfinished completions; `checkpoint`: each keeps a prefix checkpoint
        of what it computed. `outcome`: the counter it adds to (a failed request is not an abort)."""
        deltas = [self._finish(c, "abort", checkpoint) for c in state.completions.values() if not c.seq.finished]
        self.structured.release(state.info.request_id)
        self.counters[outcome] += 1
        return [d for d in deltas if d is not None]

    def close(self) -> None:
        """Let the engine's host memory go (the host tier's pinned slabs, the disk tier's threads)
        and keep its measured prefill rate beside the disk's files; the counters stay readable.
        The engine serves no more afterwards."""
        self.pic.costs.keep()
        if self.store.lower is not None:
            self.store.lower.close()

    def has_work(self) -> bool:
        lane = self.runner.lane
        return self.scheduler.has_work or bool(self.pic.fetching) or (lane is not None and lane.busy)

    def waiting_sequences(self) -> int:
        """Completions not yet running, as admission counts them (see AsyncEngine)."""
        return sum(self._waiting_count(seq) for seq in self.scheduler.waiting)

    def _waiting_count(self, seq: Sequence) -> int:
        """A request's first sequence stands for all n until they fork; a segment prefill is no request."""
        if seq.pic.job is not None:
            return 0
        state = self.requests.get(seq.info.request_id)
        unforked = seq.index == 0 and state is not None and len(state.completions) == 1
        return seq.info.params.n if unforked else 1

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        with self.runner.step_stream():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        for job in self.pic.poll():  # disk reads finished since the last step
            self.scheduler.add(job, first=True)
        self._look_ahead()
        batch = self._schedule()
        self.last_step_ran = bool(batch.chunks)
        if not batch.chunks:
            return []
        self.steps += 1
        self.step_clock.start(_step_work(batch))
        began = time.perf_counter()
        try:
            computed = self._compute(batch)
        except torch.OutOfMemoryError as error:  # torch.cuda.OutOfMemoryError too (the same class)
            figures = _memory_figures(str(error))
        else:
            outputs = self._advance(batch, *computed)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("step %d: %.1f ms, %s; %s: %s", self.steps, (time.perf_counter() - began) * 1e3,
                             _step_line(batch), self.runner.launched, self.runner.parts.times())
            return outputs
        # outside the except block, whose traceback holds the step's tensors until it ends
        self.scheduler.drop_step(batch)
        return self._fail_step(batch, *figures)

    def _schedule(self) -> ScheduledBatch:
        """The next batch, after keeping what the cold lane finished; if nothing can run until the
        lane is done, the host waits for it."""
        self._land()
        batch = self.scheduler.schedule()
        if not batch.chunks and self._land(wait=True):
            batch = self.scheduler.schedule()
        return batch

    def _land(self, *, wait: bool = False) -> bool:
        """Keeps the captures of the cold lane's chunks once they are done (stores the tuples of the
        jobs they end, which then finish); whether any landed."""
        landed = self.runner.land(wait=wait)
        if landed is None:
            return False
        try:
            done = self.pic.keep(*landed)
        except torch.OutOfMemoryError:  # its copies found no memory: the job goes, as in a failed step
            self._drop_jobs([c.seq for c in landed[0].chunks if c.seq.pic.job is not None and not c.seq.finished])
            return True
        for job in done:
            self.scheduler.finish(job, "stop")
        return True

    def _compute(self, batch: ScheduledBatch) -> tuple[PendingMasks | None, torch.Tensor, list[Sequence]]:
        """The step's device work (where it can run out of memory) and what keeps the cold jobs'
        tuples: (masks, logits, finished cold jobs). Changes nothing the step's failure must undo
        but what its sequences hold (pages, slots, pins: `_fail_step` frees them)."""
        self.pic.scatter(batch)
        masks = self.structured.fill(batch)  # beside the forward, if not prefetched
        scoring, scored = self._prompt_scoring(batch)
        logits, captures, scores = self.runner.execute(batch, scoring, timed=logger.isEnabledFor(logging.DEBUG))
        if self.runner.last_on_lane:
            self.step_clock.start(None)  # its prefill ran on the lane: the step's time says nothing of it
        done = self.pic.after_step(batch, captures)
        if scores is not None:
            self._record_prompt_scores(scored, scores)
        return masks, logits, done

    def _advance(self, batch: ScheduledBatch, masks: PendingMasks | None, logits: torch.Tensor,
                 finished_jobs: list[Sequence]) -> list[RequestOutput]:
        """After a step's forward: computed counts and checkpoints, then each sampling row's token.
        Sampling's device work (a float32 copy of the rows' logits, softmaxes) can run out of memory
        too: then the step's requests fail as in a failed forward, though what it computed is kept."""
        self.scheduler.after_step(batch)
        for job in finished_jobs:
            self.scheduler.finish(job, "stop")
        rows = self._sampling_rows(batch)
        try:
            picked = self._sample(logits, rows, masks) if rows else None
        except torch.OutOfMemoryError as error:
            figures = _memory_figures(str(error))
        else:
            return self._take_tokens(batch, rows, picked)
        return self._fail_step(batch, *figures, computed=True)

    def _sample(self, logits: torch.Tensor, rows: list[tuple[int, Completion]],
                masks: PendingMasks | None) -> SampleResult:
        index = [i for i, _ in rows]
        return self.sampler.sample(_logits_rows(logits, index), [self._sampling_row(c) for _, c in rows],
                                   masks and masks.token_mask(index))

    def _take_tokens(self, batch: ScheduledBatch, rows: list[tuple[int, Completion]],
                     picked: SampleResult | None) -> list[RequestOutput]:
        deltas: dict[str, list[CompletionDelta]] = {}
        if picked is not None:
            grammar_done = self.structured.advance([(c.seq, t) for (_, c), t in zip(rows, picked.token_ids)])
            for (_, completion), token, logprob, done in zip(rows, picked.token_ids, picked.logprobs, grammar_done):
                self._take_token(completion, token, logprob, done, deltas)
            self.structured.prefetch(c.seq for _, c in rows)  # the next masks, beside everything until sampling
        for chunk in batch.chunks:
            if chunk.seq.info.params.max_tokens == 0 and chunk.samples and not chunk.seq.finished:
                self._collect(deltas, chunk.seq, self._finish(self._completion(chunk.seq), "length"))
        self.step_clock.stop()
        return self._outputs(deltas)

    def _fail_step(self, batch: ScheduledBatch, asked: int | None, free: int | None, *,
                   computed: bool = False) -> list[RequestOutput]:
        """A step that ran out of device memory: its requests (those it admitted too) fail with
        StepOutOfMemoryError and free what they hold, keeping no checkpoint (their state slots are
        half-written, or `computed` but never sampled); its unfinished cold jobs are dropped unless
        `computed`; everyone else goes on."""
        self.counters["steps_oom"] += 1
        self.runner.join_lane()  # what the step's jobs free may still be the lane's
        seqs = dict.fromkeys([*(c.seq for c in batch.chunks), *batch.admitted])  # once each, in order
        request_ids = list(dict.fromkeys(s.info.request_id for s in seqs if s.pic.job is None))
        error = StepOutOfMemoryError(batch.num_tokens, len(request_ids), asked, free)
        logger.warning("%s (failed: %s)", error, ", ".join(request_ids) or "no request, only cold segments")
        self._drop_jobs([s for s in seqs if s.pic.job is not None and not computed])
        outputs = [self._fail(request_id, error) for request_id in request_ids if request_id in self.requests]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed step had cached goes back to the driver
        return outputs

    def _drop_jobs(self, jobs: list[Sequence]) -> None:
        """Cold jobs whose state a failed step left half-written: no checkpoint, no tuple stored."""
        for job in jobs:
            self.scheduler.finish(job, "abort", checkpoint=False)
            self.pic.drop_job(job)

    def _fail(self, request_id: str, error: StepOutOfMemoryError) -> RequestOutput:
        state = self.requests.pop(request_id)
        self._end(state, checkpoint=False, outcome="failed")
        return dataclasses.replace(state.output([]), error=error)

    def _look_ahead(self) -> None:
        """The requests the scheduler takes next (as many as it has seats for, and a few more so that
        their promotion copies overlap the steps before they run) look up their segments; the others
        hold nothing of the pool, whatever the queue's length."""
        queue = self.scheduler.admission_queue()
        cut = self.scheduler.free_seats + ADMISSION_LOOKAHEAD
        for job in self.pic.look_ahead(queue[:cut], queue[cut:]):
            self.scheduler.add(job, first=True)

    def _request_state(self, info: RequestInfo) -> RequestState:
        state = RequestState(info)
        if info.params.prompt_logprobs is not None:  # nothing predicts the first prompt token
            first = info.prompt_ids[0]
            state.prompt_scores[0] = TokenLogprob(first, self.tokenizer.token_text(first), None)
        return state

    def _prompt_scoring(self, batch: ScheduledBatch) -> tuple[PromptScoring | None, list[tuple[RequestState, int]]]:
        """The rows of the step whose hidden states score prompt tokens (requests with prompt_logprobs),
        and the (request, position) of each."""
        rows, scored, taken, offset = [], [], set(), batch.num_decodes  # a decode (one token) scores nothing
        for scheduled in batch.chunks[batch.num_decodes:]:
            chunk, request_id = scheduled.chunk, scheduled.seq.info.request_id
            state = self.requests.get(request_id)  # None: a cold PIC segment's job
            fresh = [p for p in state.unscored(chunk.start, chunk.end) if (request_id, p) not in taken] if state else []
            taken.update((request_id, p) for p in fresh)  # two of its completions in one step (resumed)
            rows += [offset + p - chunk.start for p in fresh]  # no cached pieces: one row per position
            scored += [(state, p) for p in fresh]
            offset += chunk.num_tokens
        if not rows:
            return None, []
        targets = tuple(state.info.prompt_ids[p + 1] for state, p in scored)
        return PromptScoring(tuple(rows), targets, max(s.info.params.prompt_logprobs for s, _ in scored)), scored

    def _record_prompt_scores(self, scored: list[tuple[RequestState, int]], scores: PromptScores) -> None:
        text = self.tokenizer.token_text
        for i, (state, position) in enumerate(scored):
            k, token = state.info.params.prompt_logprobs, state.info.prompt_ids[position + 1]
            top = tuple((t, text(t), lp) for t, lp in zip(scores.top_ids[i][:k], scores.top_logprobs[i][:k]))
            state.prompt_scores[position + 1] = TokenLogprob(token, text(token), scores.logprobs[i], top, scores.ranks[i])

    def _sampling_rows(self, batch: ScheduledBatch) -> list[tuple[int, Completion]]:
        """(logits row, completion) pairs; the n completions of a request share its prefill row."""
        rows: list[tuple[int, Completion]] = []
        sampling = [c for c in batch.chunks if c.samples]
        for row, chunk in enumerate(sampling):
            if chunk.seq.info.params.max_tokens == 0 or chunk.seq.finished:
                continue
            rows.extend((row, c) for c in self._fork_if_first(chunk))
        return rows

    def _fork_if_first(self, chunk: ScheduledChunk) -> list[Completion]:
        state = self.requests[chunk.seq.info.request_id]
        first = chunk.seq.index == 0 and not chunk.seq.output_ids and len(state.completions) == 1
        if not first or chunk.seq.info.params.n == 1:
            return [state.completions[chunk.seq.index]]
        for index in range(1, chunk.seq.info.params.n):
            child = Sequence(chunk.seq.info, index)
            if not self.scheduler.fork(chunk.seq, child):
                self.scheduler.add(child)  # no memory now: it recomputes the prompt later
            self._new_completion(state, child)
        return [c for c in state.completions.values() if c.seq.num_computed == chunk.seq.num_computed]

    def _take_token(self, completion: Completion, token: int, logprob, grammar_done: bool, deltas) -> None:
        seq = completion.seq
        self.requests[seq.info.request_id].mark_first_token()
        seq.append(token)
        self.counters["generated"] += 1
        stopped_by_text = completion.add_token(token, logprob)
        reason = self._finish_reason(seq, token, stopped_by_text or grammar_done)
        delta = completion.delta(None) if reason is None else self._finish(completion, reason)
        self._collect(deltas, seq, delta)

    def _finish_reason(self, seq: Sequence, token: int, stopped_by_text: bool) -> str | None:
        params = seq.info.params
        if stopped_by_text or token in params.stop_token_ids or (
                token in self.eos_ids and not params.ignore_eos):
            return "stop"
        at_max = params.max_tokens is not None and len(seq.output_ids) >= params.max_tokens
        return "length" if at_max or len(seq.token_ids) >= self.max_model_len else None

    def _finish(self, completion: Completion, reason: str, checkpoint: bool = True) -> CompletionDelta | None:
        self.scheduler.finish(completion.seq, reason, checkpoint=checkpoint)
        for job in self.pic.release(completion.seq):
            self.runner.join_lane()  # its chunk may still run on the lane
            self.scheduler.finish(job, "abort")
        return completion.delta(reason)

    def _outputs(self, deltas: dict[str, list[CompletionDelta]]) -> list[RequestOutput]:
        outputs = []
        for request_id, items in deltas.items():
            outputs.append(self.requests[request_id].output(items))
            if outputs[-1].finished:
                self._retire(request_id)
        return outputs

    def _retire(self, request_id: str) -> None:
        state = self.requests.pop(request_id)
        self.structured.release(request_id)
        self.counters["finished"] += 1
        self.counters["cached"] += state.info.cached_tokens

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _collect(deltas: dict[str, list[CompletionDelta]], seq: Sequence,
                 delta: CompletionDelta | None) -> None:
        if delta is not None:
            deltas.setdefault(seq.info.request_id, []).append(delta)

    def _completion(self, seq: Sequence) -> Completion:
        return self.requests[seq.info.request_id].completions[seq.index]

    def _new_completion(self, state: RequestState, seq: Sequence) -> None:
        seed = state.info.params.seed
        generator = None if seed is None else make_generator(seed + seq.index, self.device)
        if generator is not None:
            self.sampler.skip(generator, state.info.params, len(seq.output_ids))  # resumed: its draws so far
        state.completions[seq.index] = Completion(seq, self.tokenizer, generator)

    def _sampling_row(self, completion: Completion) -> SamplingRow:
        seq = completion.seq
        return SamplingRow(seq.info.params, seq.info.prompt_ids, seq.output_ids, completion.generator)

    @property
    def served_vocab_size(self) -> int:
        """Ids with a tokenizer entry and an embedding row: Kimi's tokenizer names 2 reserved ids past its model's."""
        return min(self.tokenizer.vocab_size, self.model_config.vocab_size)

    def _check_embedding_rows(self, tokens: tuple[int, ...]) -> None:
        bad = next((t for t in (min(tokens), max(tokens)) if not 0 <= t < self.served_vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} has no embedding row: ids run from 0 to {self.served_vocab_size - 1} (the "
                f"model has {self.model_config.vocab_size} rows, the tokenizer knows {self.tokenizer.vocab_size} ids)")

    def _request_info(self, prompt: SegmentedPrompt, params: SamplingParams, request_id: str,
                      cache_salt: str | None, cache_mode: str | None, group: str | None) -> RequestInfo:
        mode = cache_mode or self.config.cache_mode
        if mode not in CACHE_MODES:
            raise InvalidRequestError(f"cache_mode must be one of {CACHE_MODES}, got {mode!r}")
        if params.prompt_logprobs is not None:
            mode = "none"  # no prefix checkpoint or cached interior carries the hidden states it scores
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        validate_for_vocab(params, self.served_vocab_size)
        tokens = prompt.token_ids
        if not tokens:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        self._check_embedding_rows(tokens)
        budget = len(tokens) + (params.max_tokens or 0)
        if len(tokens) >= self.max_model_len or budget > self.max_model_len:
            raise PromptTooLongError(len(tokens), self.max_model_len, params.max_tokens or 0)
        if len(prompt.segments) > self.config.max_segments:
            raise InvalidRequestError(
                f"the prompt has {len(prompt.segments)} segments, more than max_segments={self.config.max_segments}")
        return RequestInfo(request_id, params, prompt, cache_salt, mode, self.config.seam_width, group)

    def _segment_layout(self) -> SegmentLayout:
        state_dtype = resolve_segment_state_dtype(self.config.segment_state_dtype, self.dtype)
        return SegmentLayout.from_cache_shape(self.model.cache_shape(), state_dtype, self.dtype)

    def _plan_memory(self, layout: SegmentLayout) -> tuple[CachePlan, int, int]:
        shape = self.model.cache_shape()
        weight_bytes = sum(t.numel() * t.element_size() for t in self.model.parameters())
        total = cache_budget_bytes(self.config, self.device, self.config.max_num_batched_tokens,
                                   self.model_config.hidden_size, weight_bytes)
        pool = total // 4 if self.config.segment_pool_bytes is None else self.config.segment_pool_bytes
        budget = total - pool
        model_max = self.model_config.max_position_embeddings
        wanted = min(self.config.max_model_len or model_max, model_max)
        if self.config.max_model_len and self.config.max_model_len > model_max:
            raise InvalidRequestError(
                f"max_model_len={self.config.max_model_len} exceeds the model's {model_max} positions")
        # cpu_cache_bytes budgets the caches alone, as cache_budget_bytes reserves no activations on CPU
        step_tokens = self.config.max_num_batched_tokens if self.device.type == "cuda" else 0
        plan, max_model_len = plan_beside_capture(
            shape, CaptureWorkspace.of(layout, step_tokens=step_tokens), budget_bytes=budget, max_model_len=wanted,
            fit_context=self.config.max_model_len is None, block_size=self.config.block_size, dtype=self.dtype,
            max_num_seqs=self.config.max_num_seqs)
        return plan, max_model_len, pool

    def _build_caches(self, plan: CachePlan, pool_bytes: int, layout: SegmentLayout) -> None:
        bs, shape = self.config.block_size, self.model.cache_shape()
        # One extra page and slot: the scratch that CUDA-graph padding rows write into.
        self.caches = ModelCaches(shape, plan.num_blocks + 1, bs, plan.num_slots + 1, self.dtype, self.device)
        self.blocks, self.slots = BlockPool(plan.num_blocks), SlotPool(plan.num_slots)
        max_checkpoints = max(1, int(plan.num_slots * self.config.prefix_cache_fraction))
        self.prefix = PrefixCache(self.blocks, self.slots, self.caches, bs, max_checkpoints)
        long_prefill = resolve_long_prefill_threshold(self.config.long_prefill_token_threshold, self.device)
        limits = SchedulerLimits(self.config.max_num_seqs, self.config.max_num_batched_tokens, bs, long_prefill)
        self.scheduler = Scheduler(limits, self.blocks, self.slots, self.prefix, self.caches, PrefillCost())
        settings = RunnerSettings(bs, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                  self.max_model_len, self.tokenizer.vocab_size,
                                  not self.config.enforce_eager and self.device.type == "cuda")
        lower = build_lower_tiers(self.config, self.device, layout, pool_bytes, self._fingerprint(), self.model_dir,
                                  self.max_model_len)
        self.store = SegmentStore(layout, pool_bytes, self.device, lower)
        c = self.model_config
        inv_freq = rope_inv_freq(c.rotary_dim, c.rope_theta).to(self.device)
        costs = ReadOrRecompute.for_tiers(lower)
        self.pic = PicAssembler(self.store, self.caches, inv_freq, self._fingerprint(),
                                shape.conv_kernel, self.config.seam_width, costs)
        self.step_clock = StepClock(self.device, (costs, self.scheduler.cost))
        self.runner = ModelRunner(self.model, self.caches, settings, scratch_slot=plan.num_slots,
                                  scratch_block=plan.num_blocks, store=self.store)
        self.runner.capture_graphs()

    def _fingerprint(self) -> str:
        """What makes two engines' segment tuples interchangeable: the model and its precision."""
        config = (self.model_dir / "config.json").read_bytes()
        return f"{xxhash.xxh64(config).hexdigest()}:{self.dtype}"

    def _tier_capacities(self, typical_tokens: int = 1024) -> str:
        """Each segment tier's capacity in segments of a typical (1k-token) size."""
        entry = self.store.layout.entry_bytes(typical_tokens)
        lower = self.store.lower
        tiers = [("pool", self.store.capacity_bytes), ("host", lower.capacity_bytes if lower else 0),
                 ("disk", lower.disk.capacity_bytes if lower and lower.disk else 0)]
        line = "segment tiers (1k-token segments): " + ", ".join(
            f"{name} {capacity // entry}" for name, capacity in tiers if capacity)
        if lower and lower.disk:
            line += f" (disk reads {lower.disk.read_bytes_per_s / 1e9:.2f} GB/s)"
        return line

    def _disk_stats(self) -> DiskStats | None:
        lower, costs = self.store.lower, self.pic.costs
        if lower is None or lower.disk is None:
            return None
        return dataclasses.replace(lower.disk.stats(), recompute_tokens_per_s=costs.tokens_per_s,
                                   recomputed=costs.recomputed, late=costs.late)

    def stats(self) -> EngineStats:
        c = self.counters
        lower = self.store.lower
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.plan.num_blocks, kv_blocks_free=self.blocks.num_free,
            block_size=self.config.block_size, state_slots_total=self.plan.num_slots,
            state_slots_free=self.slots.num_free, prefix_cache=self.prefix.stats(),
            segment_pool=self.store.stats(), segment_host=lower.stats() if lower else None,
            segment_disk=self._disk_stats(),
            requests_finished=c["finished"], requests_aborted=c["aborted"],
            requests_failed=c["failed"], prompt_tokens=c["prompt"],
            generated_tokens=c["generated"], cached_tokens=c["cached"],
            preemptions=self.scheduler.preemptions, steps_out_of_memory=c["steps_oom"])


def _step_work(batch: ScheduledBatch) -> StepWork | None:
    """What the step computes from scratch, or None when it composes cached pieces (then its time
    says little about the prefill rate)."""
    if any(c.chunk.cached for c in batch.chunks):
        return None
    prefills = [c.chunk for c in batch.chunks[batch.num_decodes:]]
    return StepWork(sum(c.num_tokens for c in prefills), sum(chunk_attention(c.start, c.num_tokens) for c in prefills),
                    batch.num_decodes, sum(c.start for c in prefills))


_PLURALS = {"decode": "decodes", "assembly": "assemblies", "cold chunk": "cold chunks", "prefill": "prefills"}


def _step_line(batch: ScheduledBatch) -> str:
    """What a step held, for the debug log: "4 decodes, 2 assemblies (310 tokens), 1 cold chunk (512 tokens)"."""
    kinds: dict[str, list[int]] = {}
    for i, scheduled in enumerate(batch.chunks):
        kind = ("decode" if i < batch.num_decodes else "cold chunk" if scheduled.seq.pic.job is not None
                else "assembly" if scheduled.chunk.cached else "prefill")
        kinds.setdefault(kind, []).append(scheduled.chunk.num_tokens)
    return ", ".join(f"{len(n)} {_PLURALS[kind] if len(n) > 1 else kind}"
                     + ("" if kind == "decode" else f" ({sum(n)} tokens)") for kind, n in kinds.items())


def _memory_figures(message: str) -> tuple[int | None, int | None]:
    """(bytes asked, bytes free) from torch's message: "Tried to allocate 640.00 MiB. GPU 0 has a
    total capacity of 139.80 GiB of which 163.12 MiB is free"; None where it says nothing."""
    asked = re.search(r"Tried to allocate ([\d.]+) ([KMGT]?i?B)", message)
    free = re.search(r"of which ([\d.]+) ([KMGT]?i?B) is free", message)
    return tuple(None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)]) for m in (asked, free))


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _logits_rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """The rows the step samples from, in order: the logits themselves when that is every row once
    (the usual step), else a gather."""
    if index == list(range(logits.shape[0])):
        return logits
    return logits[host_to_device(index, torch.long, logits.device)]


def _check_resume(resume: Mapping[int, list[int]], params: SamplingParams) -> None:
    for index, output_ids in resume.items():
        if not 0 <= index < params.n:
            raise InvalidRequestError(f"resume: completion {index} is outside the request's n={params.n}")
        if params.max_tokens is not None and len(output_ids) >= params.max_tokens:
            raise InvalidRequestError(f"resume: completion {index} has {len(output_ids)} tokens, "
                                      f"max_tokens={params.max_tokens} already")
