"""Constrained decoding through llguidance: grammars, matchers and token masks for the engine.

- Grammars compile once per distinct grammar text (an LRU of compiled matchers), on a thread of
  their own, started when the request is added; its prefill runs meanwhile.
- Each constrained completion has its own matcher, a copy of one of the grammar's compiled matchers.
  Copies of one matcher share its lexer state behind a lock (llguidance's `deep_copy` leaves it
  shared), so their masks are computed one at a time: while every compiled matcher of a grammar is
  copied by a live completion, another is compiled (~1 ms for a JSON schema), up to one per mask
  thread, and a completion copies the least used. Forks
  happen before the first token, so a fork starts from the initial state like its parent.
- Masks are filled by llguidance's parallel executor on a thread of their own, into rows of one
  bitmask buffer reused every step (pinned on CUDA): no host tensor op on the engine thread, where a
  busy host made small ones cost milliseconds. A completion's next mask is started as soon as it
  consumed its token (`prefetch`), so it runs beside the rest of the step, the next step's host work
  and the next forward; a row the prefetch did not cover is filled when its step starts.
- The sampled tokens are consumed in one parallel call (`advance`); the sampler applies the masks
  of the constrained rows only.
- A batch without constrained rows costs a dict lookup per row (fill, advance, prefetch): no mask,
  no thread, no sync.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from hypic.engine.sampler import TokenMask
from hypic.engine.scheduler import ScheduledBatch
from hypic.engine.sequence import Sequence
from hypic.kernels import token_mask
from hypic.structured_outputs import StructuredOutputs

logger = logging.getLogger("hypic")
_CACHED_GRAMMARS = 256
# llguidance's own default for its mask threads: 80 % of the CPUs, at most 32
MASK_THREADS = min(32, max(1, (os.cpu_count() or 1) * 4 // 5))


@dataclass
class _Constrained:
    """One completion's matcher; with `after`, the constraint starts once that text was generated."""

    compiled: Future
    base: int  # which of the grammar's compiled matchers `compiled` is
    after: bytes | None
    matcher: llguidance.LLMatcher | None = None
    tail: bytes = b""  # the last bytes generated while waiting for `after`
    failed: bool = False  # the grammar did not compile for this tokenizer

    @property
    def started(self) -> bool:
        return self.after is None

    def ready(self) -> llguidance.LLMatcher:
        if self.matcher is None:
            self.matcher = self.compiled.result().deep_copy()
        return self.matcher


class _Grammar:
    """One grammar's compiled matchers: the first compiled at once (beside the request's prefill), another
    only while every one is copied by a live completion, up to `width`; a completion copies the least used."""

    def __init__(self, compile_one: Callable[[], Future], width: int) -> None:
        self._compile_one, self._width = compile_one, width
        self._compiled, self._users = [compile_one()], [0]

    def take(self) -> tuple[int, Future]:
        base = min(range(len(self._users)), key=self._users.__getitem__)
        if self._users[base] and len(self._compiled) < self._width and not self._failed():
            base = len(self._compiled)
            self._compiled.append(self._compile_one())
            self._users.append(0)
        self._users[base] += 1
        return base, self._compiled[base]

    def give_back(self, base: int) -> None:
        self._users[base] -= 1

    def _failed(self) -> bool:
        """The grammar is known not to compile for this tokenizer: no point compiling it again."""
        return self._compiled[0].done() and self._compiled[0].result().is_error()


class PendingMasks:
    """Bitmasks being filled beside the forward: `places` maps a sampling chunk's row to its bitmask row."""

    def __init__(self, bitmask: torch.Tensor, places: dict[int, int], done: Future) -> None:
        self._bitmask, self._places, self._done = bitmask, places, done

    def token_mask(self, index: list[int]) -> TokenMask:
        """The masks of the sampler's rows, once filled; row i samples from chunk row index[i]."""
        self._done.result()
        pairs = [(i, self._places[chunk_row]) for i, chunk_row in enumerate(index) if chunk_row in self._places]
        return TokenMask(pairs, self._bitmask[: max((source for _, source in pairs), default=-1) + 1])


_Key = tuple[str, int]  # a completion: (request id, index)


class StructuredDecoding:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int], device: torch.device) -> None:
        self.words, self._pinned = (vocab_size + 31) // 32, device.type == "cuda"  # pinned: copies without a sync
        token_mask.warm_up(device, vocab_size)
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="hypic-grammar")
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="hypic-mask")  # one at a time: jobs share the buffer
        # built on the compiler's thread: the first compile waits for it, the engine never does
        self._tokenizer = self._compiler.submit(
            llguidance.LLTokenizer, tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._executor = llguidance.LLExecutor(MASK_THREADS)
        self._bitmask = torch.empty((0, self.words), dtype=torch.int32)
        self._ahead: dict[_Key, int] = {}  # the last prefetch: completion -> its bitmask row
        self._last: Future | None = None  # the last fill queued
        self._compiled: OrderedDict[str, _Grammar] = OrderedDict()
        self._requests: dict[str, tuple[_Grammar, dict[int, _Constrained]]] = {}  # grammar, per completion

    def add(self, request_id: str, structured: StructuredOutputs | None) -> None:
        if structured is not None:
            self._requests[request_id] = (self._compile(structured.grammar()), {})

    def release(self, request_id: str) -> None:
        grammar, states = self._requests.pop(request_id, (None, {}))
        for state in states.values():
            grammar.give_back(state.base)
        # its prefetched masks are stale: a later request under the same id must not take them
        self._ahead = {key: row for key, row in self._ahead.items() if key[0] != request_id}

    def fill(self, batch: ScheduledBatch) -> PendingMasks | None:
        """The masks of the batch's constrained rows (prefetched or started now); None when it has none."""
        sampling = [chunk.seq for chunk in batch.chunks if chunk.samples]
        wanted = [(row, seq) for row, seq in enumerate(sampling) if self._maskable(seq)]
        if not wanted:
            return None
        ahead, self._ahead = self._ahead, {}
        missing = [seq for _, seq in wanted if _key(seq) not in ahead]
        if missing:  # after every prefetched row (a released request's leaves a gap)
            ahead.update(self._start(missing, first_row=max(ahead.values(), default=-1) + 1))
        return PendingMasks(self._bitmask, {row: ahead[_key(seq)] for row, seq in wanted}, self._last)

    def prefetch(self, seqs: Iterable[Sequence]) -> None:
        """Starts the next masks of completions that just consumed a token (call after `advance`)."""
        live = [seq for seq in seqs if not seq.finished and self._maskable(seq)]
        self._ahead = self._start(live, first_row=0) if live else {}

    def advance(self, tokens: list[tuple[Sequence, int]]) -> list[bool]:
        """Feeds each sampled token to its completion's matcher, all in one parallel call; True where
        that completion's grammar is finished."""
        fed = []
        for position, (seq, token) in enumerate(tokens):
            state = self._state(seq) if seq.info.request_id in self._requests else None
            if state is not None and not state.started:
                self._watch_for_start(state, token)
            elif state is not None:
                fed.append((position, state.ready(), token))
        finished = [False] * len(tokens)
        if not fed:
            return finished
        self._executor.consume_token_par([(matcher, token) for _, matcher, token in fed])
        for position, matcher, _ in fed:
            if matcher.is_error():
                logger.warning("%s: structured output stopped: %s", tokens[position][0].info.request_id,
                               matcher.get_error())
            finished[position] = matcher.is_stopped()
        return finished

    def replay(self, seq: Sequence, ids: list[int]) -> None:
        """A completion resumed from the ids it made elsewhere: its matcher consumes them first."""
        for token in ids:
            self.advance([(seq, token)])

    def _maskable(self, seq: Sequence) -> bool:
        if seq.info.request_id not in self._requests:
            return False
        state = self._state(seq)
        return state.started and not state.failed

    def _start(self, seqs: list[Sequence], first_row: int) -> dict[_Key, int]:
        """Queues the masks of `seqs` into bitmask rows from `first_row` on; their places."""
        places = {_key(seq): first_row + i for i, seq in enumerate(seqs)}
        self._reserve(first_row + len(seqs))
        rows = [(self._state(seq), places[_key(seq)]) for seq in seqs]
        self._last = self._filler.submit(self._fill, rows, self._bitmask)
        return places

    def _reserve(self, rows: int) -> None:
        """A bitmask of at least `rows` rows. Growing waits for the queued fills and keeps their rows;
        the old buffer lives on until its pending copies are done (the caching host allocator)."""
        if self._bitmask.shape[0] >= rows:
            return
        if self._last is not None:
            self._last.result()
        grown = torch.empty((max(rows, 2 * self._bitmask.shape[0]), self.words), dtype=torch.int32,
                            pin_memory=self._pinned)
        grown[: self._bitmask.shape[0]] = self._bitmask
        self._bitmask = grown

    def _state(self, seq: Sequence) -> _Constrained:
        grammar, states = self._requests[seq.info.request_id]
        if seq.index not in states:
            after = seq.info.params.structured.after
            base, compiled = grammar.take()
            states[seq.index] = _Constrained(compiled, base, after.encode() if after else None)
        return states[seq.index]

    def _watch_for_start(self, state: _Constrained, token: int) -> None:
        state.tail = (state.tail + self._tokenizer.result().decode_bytes([token]))[-4 * len(state.after):]
        if state.after in state.tail:
            state.after = None

    def _fill(self, rows: list[tuple[_Constrained, int]], bitmask: torch.Tensor) -> None:
        for state, row in rows:
            state.failed = state.ready().is_error()  # a tokenizer-specific compile error: unconstrained, then stopped
            if state.failed:
                bitmask[row] = -1
        live = [(state.matcher, row) for state, row in rows if not state.failed]
        self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])

    def _compile(self, grammar: str) -> _Grammar:
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
            return self._compiled[grammar]
        self._compiled[grammar] = _Grammar(lambda: self._compiler.submit(self._new_matcher, grammar), MASK_THREADS)
        if len(self._compiled) > _CACHED_GRAMMARS:
            self._compiled.popitem(last=False)  # matchers made from it keep it alive
        return self._compiled[grammar]

    def _new_matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)
        if matcher.is_error():
            logger.warning("structured output: grammar does not compile for this tokenizer: %s", matcher.get_error())
        return matcher


def _key(seq: Sequence) -> _Key:
    return seq.info.request_id, seq.index
