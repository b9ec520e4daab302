"""Per-request output bookkeeping: detokenization, stop conditions and the deltas to emit."""
from __future__ import annotations

import time

import torch

from hypic.engine.text.detokenizer import IncrementalDetokenizer
from hypic.engine.sequence import RequestInfo, Sequence
from hypic.engine.text.stop import StopStringMatcher
from hypic.engine.text.tokenizer import Tokenizer
from hypic.outputs import CompletionDelta, RequestMetrics, RequestOutput, TokenLogprob


class Completion:
    """Text state of one of the request's n completions."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, generator: torch.Generator | None) -> None:
        params = seq.info.params
        self.seq, self.generator = seq, generator
        self.detok = IncrementalDetokenizer(tokenizer, seq.info.prompt_ids,
                                            skip_special_tokens=params.skip_special_tokens)
        self.stop = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        for token_id in seq.output_ids:  # resumed: rebuild the text state; that text was emitted elsewhere
            self.stop.push(self.detok.push([token_id]))
        self.stopped_by_text = False
        self.pending_text = ""
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []

    def add_token(self, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Takes a sampled token; True when a stop string ended the completion."""
        self.pending_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        check = self.stop.push(self.detok.push([token_id]))
        self.pending_text += check.text
        self.stopped_by_text = check.stopped
        return check.stopped

    def delta(self, finish_reason: str | None) -> CompletionDelta | None:
        if finish_reason is not None and not self.stopped_by_text:
            self.pending_text += self.stop.push(self.detok.flush()).text + self.stop.flush()
        text, self.pending_text = self.pending_text, ""
        if not (text or self.pending_ids or finish_reason):
            return None
        logprobs = tuple(self.pending_logprobs) if self.seq.info.params.logprobs is not None else None
        delta = CompletionDelta(self.seq.index, text, tuple(self.pending_ids), logprobs, finish_reason)
        self.pending_ids, self.pending_logprobs = [], []
        return delta


class RequestState:
    def __init__(self, info: RequestInfo) -> None:
        self.info = info
        self.completions: dict[int, Completion] = {}  # sequence index -> completion
        self.token_steps = 0
        self.token_step_times: tuple[float, float] | None = None  # time.monotonic() of the first and latest
        self.prompt_scores: dict[int, TokenLogprob] = {}  # prompt position -> its logprob (params.prompt_logprobs)
        # the engine enters position 0 (logprob None) on arrival, the rest as steps score them
        self.prompt_logprobs_sent = False

    @property
    def sequences(self) -> list[Sequence]:
        return [c.seq for c in self.completions.values()]

    @property
    def finished(self) -> bool:
        # Forking happens before the first token, so no completion appears after all have finished.
        return all(c.seq.finished for c in self.completions.values())

    def output(self, deltas: list[CompletionDelta]) -> RequestOutput:
        gap = self._token_step() if any(d.token_ids for d in deltas) else None
        return RequestOutput(self.info.request_id, tuple(deltas), self.finished, self.metrics(gap),
                             self._prompt_logprobs())

    def unscored(self, start: int, end: int) -> list[int]:
        """Positions in [start, end) whose hidden states score a prompt token not scored yet (the
        hidden state at p scores token p + 1; a preempted request's recompute scores nothing again)."""
        if self.info.params.prompt_logprobs is None:
            return []
        last = len(self.info.prompt_ids) - 1
        return [p for p in range(start, min(end, last)) if p + 1 not in self.prompt_scores]

    def _prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Every prompt token's logprob, once, as soon as all are scored."""
        length = len(self.info.prompt_ids)
        if self.info.params.prompt_logprobs is None or self.prompt_logprobs_sent or len(self.prompt_scores) < length:
            return None
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_scores[p] for p in range(length))

    def _token_step(self) -> float | None:
        """Seconds since the previous step that gave this request tokens (None for the first)."""
        now, times = time.monotonic(), self.token_step_times
        self.token_steps += 1
        self.token_step_times = (now if times is None else times[0], now)
        return None if times is None else now - times[1]

    def metrics(self, inter_token_latency: float | None) -> RequestMetrics:
        info = self.info
        return RequestMetrics(
            arrival_time=info.arrival_time,
            queue_time=_since(info.arrival_time, info.first_scheduled_time),
            ttft=_since(info.arrival_time, info.first_token_time),
            prompt_tokens=len(info.prompt_ids), cached_tokens=info.cached_tokens,
            cached_tokens_by_kind=dict(info.cached_tokens_by_kind),
            generated_tokens=sum(len(c.seq.output_ids) for c in self.completions.values()),
            token_steps=self.token_steps,
            inter_token_latency=inter_token_latency,
            decode_time=None if self.token_step_times is None else self.token_step_times[1] - self.token_step_times[0])

    def mark_first_token(self) -> None:
        if self.info.first_token_time is None:
            self.info.first_token_time = time.monotonic()


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start
