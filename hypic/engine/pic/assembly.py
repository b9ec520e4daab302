"""The engine's PIC side: plans segments, runs cold ones as child jobs, feeds tuples to requests.

Flow (DESIGN §3): a request's middle segments are looked up in the segment store once the
scheduler is about to take it (`look_ahead`: the next requests it admits, as many as the pool has
room for); hits become `Cached` pieces of its sequence (pinned; a lower-tier hit is promoted),
misses become cold child jobs (one per key, however many requests want it). A request that stops
being next before it runs gives its pins back and is looked up again later: queued requests never
hold the pool that the admitted ones promote into. A cold job is an isolated prefill, chunked like
any other, whose tuple is captured chunk by chunk (composed exactly across chunks) and stored after
its last chunk; the requests waiting for it then get their pieces. A miss only the disk holds is
read instead when the cost model finds that no slower (`ReadOrRecompute`), with a deadline: the
requests stop waiting for a read not done by then, and its segment becomes a cold job. When
nothing is awaited the sequence is admitted like any other: its interiors' K/V are scattered into
its pages at admission, and linear layers compose the pieces as its chunks reach them.
"""
from __future__ import annotations

import itertools
from collections import defaultdict

import torch

from hypic.cache.segment_store import SegmentKey, SegmentStore, SegmentTuple
from hypic.engine.pic.plan import PicPolicy, PlannedSegment, SegmentJob, plan_segments
from hypic.engine.pic.pieces import Cached
from hypic.engine.pic.read_cost import ReadOrRecompute
from hypic.engine.scheduler import ScheduledBatch
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.sequence import RequestInfo, Sequence
from hypic.kernels.host_copy import host_to_device
from hypic.kernels.scatter_kv import scatter_kv
from hypic.models.batch import Capture, TupleSoFar
from hypic.sampling_params import SamplingParams

_PREFILL_ONLY = SamplingParams(max_tokens=0)


class PicAssembler:
    def __init__(self, store: SegmentStore, caches, inv_freq: torch.Tensor, fingerprint: str,
                 conv_kernel: int, seam_width: int, costs: ReadOrRecompute) -> None:
        self.store, self.caches, self.inv_freq, self.costs = store, caches, inv_freq, costs
        self.fingerprint, self.conv_kernel, self.seam_width = fingerprint, conv_kernel, seam_width
        self.jobs: dict[SegmentKey, Sequence] = {}  # cold segments being prefilled
        self.waiters: dict[SegmentKey, list[tuple[Sequence, PlannedSegment]]] = defaultdict(list)
        self.fetching: set[SegmentKey] = set()  # disk reads for a peer's pull, promoted when done
        self.reads: dict[SegmentKey, float] = {}  # disk reads requests wait for -> deadline (`costs.clock`)

    def plan(self, prompt: SegmentedPrompt, mode: str, salt: str | None) -> list[PlannedSegment]:
        if mode not in ("hypic", "naive"):
            return []
        return plan_segments(prompt, PicPolicy(mode, self.seam_width, self.conv_kernel), self.fingerprint, salt)

    @staticmethod
    def queue(seq: Sequence, planned: list[PlannedSegment]) -> None:
        """Keep a new sequence's segments until the scheduler is about to take it (`look_ahead`)."""
        seq.pic.planned, seq.pic.attached = planned, not planned
        if planned:
            seq.pic.approximate_from = planned[0].span[0]

    def look_ahead(self, ahead: list[Sequence], behind: list[Sequence]) -> list[Sequence]:
        """`ahead`: the waiting sequences the scheduler takes next, in order; `behind`: the others.
        Attaches those of `ahead` whose lookups fit the pool's room (the first always does: it
        recomputes what finds no room rather than waiting), in order; those of `behind` that only
        wait for their turn give their pins back. Returns the new cold jobs to schedule."""
        for seq in behind:
            if seq.pic.planned and seq.pic.attached and not seq.pic.awaiting:  # a cold job or read goes on for it
                self._unpin_pieces(seq)
                seq.pic.attached = False
        new_jobs = []
        for i, seq in enumerate(ahead):
            if seq.pic.attached:
                continue
            if i and self._lookup_bytes(seq) > self._room_bytes():
                break  # the rest wait for room in turn, not a later one before them
            new_jobs += self._attach(seq)
        return new_jobs

    def _attach(self, seq: Sequence) -> list[Sequence]:
        """Pieces for the hits of its planned segments, waits for the misses; returns the new cold
        jobs to schedule."""
        new_jobs, seq.pic.attached = [], True
        for segment in self._needed(seq):
            entry = self.store.get(segment.job.key)
            if entry is not None:
                self._add_piece(seq, segment, entry, entry.source)
                continue
            seq.pic.awaiting.add(segment.job.key)
            self.waiters[segment.job.key].append((seq, segment))
            if segment.job.key not in self.jobs and not self._read_from_disk(segment.job):
                new_jobs.append(self.start_job(segment.job))
        return new_jobs

    @staticmethod
    def _needed(seq: Sequence) -> list[PlannedSegment]:
        """Its planned segments but one holding the last prompt token (always computed: logits)."""
        last_computed = len(seq.token_ids) - 1
        return [segment for segment in seq.pic.planned if segment.span[1] <= last_computed]

    def _lookup_bytes(self, seq: Sequence) -> int:
        """Pool room attaching `seq` may take: the entries of its segments that nothing pins or awaits."""
        return sum(self._entry_bytes(s.job) for s in self._needed(seq)
                   if not self.store.pinned(s.job.key) and not self.waiters.get(s.job.key))

    def _room_bytes(self) -> int:
        """The pool's room left by pinned entries and by those awaited (being prefilled or read)."""
        return self.store.room_bytes - sum(self._entry_bytes(waiting[0][1].job) for waiting in self.waiters.values()
                                           if waiting)

    def _entry_bytes(self, job: SegmentJob) -> int:
        return self.store.layout.entry_bytes(job.interior[1] - job.interior[0])

    def _read_from_disk(self, job: SegmentJob) -> bool:
        """Start reading an entry only the disk holds (or go on waiting for its read), unless
        recomputing it is cheaper (then False)."""
        if self.store.tier(job.key) != "disk":
            return False
        if job.key in self.reads:
            return True
        deadline = self.costs.read_deadline(self._entry_bytes(job), len(job.token_ids), self._recomputing())
        if deadline is None or not self.store.start_read(job.key):
            return False
        self.reads[job.key] = deadline
        return True

    def _recomputing(self) -> int:
        """Tokens the cold jobs under way have still to prefill."""
        return sum(job.remaining for job in self.jobs.values())

    def poll(self) -> list[Sequence]:
        """Disk reads that finished: promoted for the requests waiting on them (or a peer); a failed
        one (or no room to promote into) is prefilled cold instead. Reads past their deadline are
        prefilled cold too, and land in host memory when they finish. Returns the new cold jobs."""
        new_jobs = []
        for key in self.store.finished_reads():
            if key in self.reads or key in self.fetching:
                new_jobs += self._landed(key)
        now = self.costs.clock()
        for key in [key for key, deadline in self.reads.items() if deadline < now]:
            del self.reads[key]
            self.costs.late += 1
            new_jobs += self._recompute(key)
        return new_jobs

    def _landed(self, key: SegmentKey) -> list[Sequence]:
        """Promote a finished read for its requests (or peer); a cold job if that fails."""
        self.reads.pop(key, None)
        self.fetching.discard(key)
        entry = self.store.get(key)
        if entry is None:
            return self._recompute(key)
        self.store.unpin(entry)
        self._wake(key, stored=True, source="disk")
        return []

    def _recompute(self, key: SegmentKey) -> list[Sequence]:
        """The cold job of a key requests wait for, unless one is under way already."""
        waiting = self.waiters.get(key)
        return [self.start_job(waiting[0][1].job)] if waiting and key not in self.jobs else []

    def scatter(self, batch: ScheduledBatch) -> None:
        """Interior K (rotated to its global positions) and V into the pages of admitted sequences;
        the pieces their prefix hits covered are unpinned."""
        for seq in batch.admitted:
            self._unpin_covered(seq)
            if seq.pic.cached:
                self._scatter_pieces(seq)

    def after_step(self, batch: ScheduledBatch, captures: list[Capture]) -> list[Sequence]:
        """Keeps each cold job's tuple so far, stores the complete ones and unpins composed pieces
        (last: a step that runs out of memory before then gives back every pin its sequences hold,
        `release`); returns the finished jobs."""
        done = self.keep(batch, captures)
        for scheduled in batch.chunks:
            for _, piece in scheduled.chunk.cached:
                self.store.unpin(piece.entry)
        return done

    def keep(self, batch: ScheduledBatch, captures: list[Capture]) -> list[Sequence]:
        """Keeps the captures of `batch`'s cold jobs that are still wanted (a job on the cold lane may
        have been dropped before its captures landed); returns the jobs that finished."""
        live = [c for c in captures if all(not batch.chunks[i].seq.finished for i in c.jobs)]
        return [job for capture in live for job in self._keep_captures(batch, capture)]

    def _keep_captures(self, batch: ScheduledBatch, capture: Capture) -> list[Sequence]:
        done, ending, going_on = [], itertools.count(), itertools.count()
        starts = itertools.accumulate(capture.spans.lens, initial=0)
        for j, (i, start) in enumerate(zip(capture.jobs, starts)):
            pic = batch.chunks[i].seq.pic
            kv = [*([] if capture.priors[j] is None else pic.captured_kv),
                  capture.staged.kv[start:start + capture.spans.lens[j]]]
            if not capture.ends[j]:  # its next chunk composes after this one's (T, S0)
                p = next(going_on)
                pic.captured = TupleSoFar([t[p] for t in capture.T], [s[p] for s in capture.S0])
                pic.captured_kv = [*kv[:-1], kv[-1].clone()]  # a copy: the step's staging is let go
                continue
            stored = self.store.put_staged(pic.job.key, pic.job.interior, capture.staged.fixed[next(ending)], kv)
            pic.captured, pic.captured_kv = None, []
            self._wake(pic.job.key, stored)
            done.append(self.jobs.pop(pic.job.key))
        return done

    def drop_job(self, seq: Sequence) -> None:
        """A cold job whose step ran out of memory: its partial tuple goes (its state slot is
        half-written) and the requests waiting for it compute the segment in full (exact)."""
        seq.pic.captured, seq.pic.captured_kv = None, []
        if self.jobs.get(seq.pic.job.key) is seq:  # else the step stored it before failing
            del self.jobs[seq.pic.job.key]
            self._wake(seq.pic.job.key, stored=False)

    def start_job(self, job: SegmentJob) -> Sequence:
        """The isolated prefill of one cold segment (one per key at a time)."""
        self.jobs[job.key] = seq = self._job_sequence(job)
        return seq

    def fetch(self, key: SegmentKey) -> None:
        """Promote a disk-only entry for a peer: its read runs off the engine thread, `poll` lands it."""
        if key not in self.fetching and self.store.start_read(key):
            self.fetching.add(key)

    def export(self, key: SegmentKey) -> SegmentTuple | None:
        """A copy of a stored tuple (to send to a peer), or None if the store lacks it."""
        entry = self.store.get(key)
        if entry is None:
            return None
        if entry.ready is not None:  # promoted just now: the clones below queue after its copy
            torch.cuda.current_stream().wait_event(entry.ready)
        views = entry.views()
        tup = SegmentTuple(views.interior, *[[t.clone() for t in getattr(views, name)]
                                             for name in ("T", "S0", "conv_tail", "K", "V")])
        self.store.unpin(entry)
        return tup

    def release(self, seq: Sequence) -> list[Sequence]:
        """A finished or aborted sequence gives back its pins and stops waiting. Returns the cold
        jobs no one waits for any more, to cancel (their partial tuples are dropped, never stored)."""
        self._unpin_pieces(seq)
        for key in seq.pic.awaiting:
            self.waiters[key] = [(s, p) for s, p in self.waiters[key] if s is not seq]
        unwanted = [key for key in seq.pic.awaiting if not self.waiters[key]]
        abandoned = [key for key in unwanted if key in self.jobs]
        seq.pic.awaiting.clear()
        for key in unwanted:
            self.reads.pop(key, None)  # it lands in host memory, for no one
        for key in abandoned:
            del self.waiters[key]
        return [self.jobs.pop(key) for key in abandoned]

    def _wake(self, key: SegmentKey, stored: bool, source: str | None = None) -> None:
        """Hand a stored key to the requests waiting for it; `source`: the tier of their hit (None:
        prefilled cold for them)."""
        for seq, segment in self.waiters.pop(key, []):
            seq.pic.awaiting.discard(key)
            entry = self.store.get(key) if stored else None
            if entry is not None:  # else the segment is computed in full: exact, only slower
                self._add_piece(seq, segment, entry, source)

    def _unpin_covered(self, seq: Sequence) -> None:
        for piece in seq.pic.covered:
            self.store.unpin(piece.entry)
        seq.pic.covered = []

    def _unpin_pieces(self, seq: Sequence) -> None:
        self._unpin_covered(seq)
        for piece in seq.pic.cached:
            self.store.unpin(piece.entry)
        seq.pic.cached = []

    @staticmethod
    def _add_piece(seq: Sequence, segment: PlannedSegment, entry, source: str | None) -> None:
        start, end = segment.span
        seq.pic.add(Cached(start, end, entry, source is not None, source or "pool"))

    def _job_sequence(self, job: SegmentJob) -> Sequence:
        job_info = RequestInfo(f"segment-{job.key.digest.hex()[:16]}", _PREFILL_ONLY,
                               SegmentedPrompt((job.token_ids,)), job.key.salt, "none", self.seam_width)
        seq = Sequence(job_info, 0)
        seq.pic.job = job
        return seq

    def _scatter_pieces(self, seq: Sequence) -> None:
        """Every piece of `seq` in one launch per full layer (per-token offsets expanded on the device)."""
        bs, device = self.caches.block_size, self.store.model_src.device
        positions, src = self.store.interior_kv_offsets([(p.start, p.entry) for p in seq.pic.cached], device)
        table = host_to_device(seq.block_ids, torch.long, device)
        dst = table[positions // bs] * bs + positions % bs  # on the device: the host gather took ~1.7 ms at 16k
        for full_index, layer_id in enumerate(self.caches.shape.full_layers):
            k_cache, v_cache = self.caches.kv(layer_id)
            scatter_kv(self.store.model_src, self.store.kv_at_layer(src, full_index), positions, k_cache, v_cache,
                       dst, self.inv_freq, self.store.layout.v_offset)
