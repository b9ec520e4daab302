"""Constrained decoding through llguidance: grammars, matchers and token masks for the engine.

- Grammars compile once per distinct grammar text (an LRU of compiled matchers), on a thread of
  their own, started when the request is added; its prefill runs meanwhile.
- Each constrained completion has its own matcher (a copy of the compiled one). Forks happen before
  the first token, so a fork starts from the compiled matcher's initial state like its parent.
- Masks are filled by llguidance's parallel executor on another thread while the forward runs, into
  one bitmask row per sampling row (-1: every token allowed); the sampler applies it.
- A batch without constrained rows costs one attribute test per row: no mask, no thread, no sync.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from hypic.engine.scheduler import ScheduledBatch
from hypic.engine.sequence import Sequence
from hypic.structured_outputs import StructuredOutputs

logger = logging.getLogger("hypic")
_CACHED_GRAMMARS = 256


@dataclass
class _Constrained:
    """One completion's matcher; with `after`, the constraint starts once that text was generated."""

    compiled: Future
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


class PendingMasks:
    """Bitmasks being filled beside the forward: one row per sampling chunk of the batch."""

    def __init__(self, bitmask: torch.Tensor, done: Future) -> None:
        self._bitmask, self._done = bitmask, done

    def rows(self, index: list[int]) -> torch.Tensor:
        """[len(index), words] int32 on the host, once filled."""
        self._done.result()
        return self._bitmask[index]


class StructuredDecoding:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.words = (vocab_size + 31) // 32
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="hypic-grammar")
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="hypic-mask")
        # built on the compiler's thread: the first compile waits for it, the engine never does
        self._tokenizer = self._compiler.submit(
            llguidance.LLTokenizer, tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._requests: dict[str, tuple[Future, dict[int, _Constrained]]] = {}  # compiled, per completion

    def add(self, request_id: str, structured: StructuredOutputs | None) -> None:
        if structured is not None:
            self._requests[request_id] = (self._compile(structured.grammar()), {})

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def fill(self, batch: ScheduledBatch) -> PendingMasks | None:
        """Starts filling the masks of the batch's constrained rows; None when it has none."""
        sampling = [chunk.seq for chunk in batch.chunks if chunk.samples]
        rows = [(row, self._state(seq)) for row, seq in enumerate(sampling) if seq.info.request_id in self._requests]
        rows = [(row, state) for row, state in rows if state.started and not state.failed]
        if not rows:
            return None
        bitmask = torch.full((len(sampling), self.words), -1, dtype=torch.int32)
        return PendingMasks(bitmask, self._filler.submit(self._fill, rows, bitmask))

    def advance(self, seq: Sequence, token: int) -> bool:
        """Feeds the sampled token to the completion's matcher; True when the grammar is finished."""
        if seq.info.request_id not in self._requests:
            return False
        state = self._state(seq)
        if not state.started:
            self._watch_for_start(state, token)
            return False
        matcher = state.ready()
        matcher.consume_token(token)
        if matcher.is_error():
            logger.warning("%s: structured output stopped: %s", seq.info.request_id, matcher.get_error())
        return matcher.is_stopped()

    def replay(self, seq: Sequence, ids: list[int]) -> None:
        """A completion resumed from the ids it made elsewhere: its matcher consumes them first."""
        for token in ids:
            self.advance(seq, token)

    def _state(self, seq: Sequence) -> _Constrained:
        compiled, states = self._requests[seq.info.request_id]
        if seq.index not in states:
            after = seq.info.params.structured.after
            states[seq.index] = _Constrained(compiled, after.encode() if after else None)
        return states[seq.index]

    def _watch_for_start(self, state: _Constrained, token: int) -> None:
        state.tail = (state.tail + self._tokenizer.result().decode_bytes([token]))[-4 * len(state.after):]
        if state.after in state.tail:
            state.after = None

    def _fill(self, rows: list[tuple[int, _Constrained]], bitmask: torch.Tensor) -> None:
        matchers = [(state.ready(), row) for row, state in rows]
        for (matcher, _), (_, state) in zip(matchers, rows):
            state.failed = matcher.is_error()  # a tokenizer-specific compile error: unconstrained, then stopped
        live = [(matcher, row) for matcher, row in matchers if not matcher.is_error()]
        self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])

    def _compile(self, grammar: str) -> Future:
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
            return self._compiled[grammar]
        self._compiled[grammar] = self._compiler.submit(self._new_matcher, grammar)
        if len(self._compiled) > _CACHED_GRAMMARS:
            self._compiled.popitem(last=False)  # matchers made from it keep it alive
        return self._compiled[grammar]

    def _new_matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)
        if matcher.is_error():
            logger.warning("structured output: grammar does not compile for this tokenizer: %s", matcher.get_error())
        return matcher
