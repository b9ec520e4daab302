"""Next-token choice for a batch of rows, each with its own SamplingParams.

Order per row (vLLM's): logit_bias -> repetition/frequency/presence penalties -> (greedy: argmax)
-> temperature -> min_p -> top_k -> top_p -> sample; each filter sees the distribution left by the
previous ones, renormalised (top_p keeps the fewest most likely tokens holding at least p of it;
top_k keeps every token tied with the k-th).
- Ids >= the tokenizer's vocab size (embedding padding) are never chosen: logits are cut there.
- Greedy: temperature < 1e-5, or top_k == 1 (exactly argmax even when bf16 logits tie).
- Penalties: repetition over prompt + output ids (logit / r if > 0 else logit * r); frequency and
  presence over output ids only (logit -= f * count + p * [count > 0]), as in OpenAI and vLLM.
- Sampling is an exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks i with probability p_i.
  A row with its own torch.Generator (a request seed) draws its E alone, so the same seed gives the
  same tokens whatever else is in the batch; unseeded rows share one batched draw.
- Logprobs are those of the raw model distribution (log_softmax of the logits before bias,
  penalties, temperature and filtering; vLLM's default "raw_logprobs"), cut to the vocab; a grammar's
  token mask comes first (as in vLLM), so a constrained row's chosen token always has a finite logprob.
- All-greedy batches without penalties, bias or logprobs cost one argmax and one host read.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hypic.errors import InvalidRequestError
from hypic.kernels.host_copy import host_to_device, read_rows
from hypic.kernels.token_mask import apply_token_mask
from hypic.outputs import TokenLogprob
from hypic.sampling_params import SamplingParams

_GREEDY_TEMPERATURE = 1e-5  # below this, logits / t overflows float32: treat it as greedy
_TINY = torch.finfo(torch.float32).tiny  # floor of E so that p / E never divides by zero


@dataclass(frozen=True)
class SamplingRow:
    """One row of the logits: the request's params, its token history and its generator."""

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    generator: torch.Generator | None = None  # on the logits' device; from make_generator(seed)


@dataclass(frozen=True)
class TokenMask:
    """Grammar masks of some rows of a batch: for each (row, source) in pairs, that logits row may take
    only the tokens words[source] allows (bit t of word w allows token 32w + t). The words stay on the
    host, pinned on CUDA so that their copy queues behind the forward instead of waiting for it."""

    pairs: list[tuple[int, int]]
    words: torch.Tensor  # [S, ceil(V / 32)] int32


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows whose params.logprobs is None
    device_token_ids: torch.Tensor  # [M] int64 on the logits' device, to feed the next step


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own generator. With n > 1 give completion i the seed `seed + i`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def validate_for_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Checks what SamplingParams cannot know alone; call it when a request is admitted."""
    bad = sorted(t for t in params.logit_bias if not 0 <= t < vocab_size)
    if bad:
        raise InvalidRequestError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_TEMPERATURE or params.top_k == 1


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


class Sampler:
    """Stateless but for the default generator of unseeded rows (one per device, seeded once)."""

    def __init__(self, vocab_size: int, token_text: Callable[[int], str], *, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self._token_text = token_text  # id -> text for logprobs, e.g. Tokenizer.token_text
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
               token_mask: TokenMask | None = None) -> SampleResult:
        """logits: [M, V] (any float dtype, any device), one SamplingRow per row. token_mask (constrained
        decoding) sets the tokens it forbids to -inf in `logits` itself."""
        logits = logits[:, : self.vocab_size]
        if token_mask is not None:
            _apply(logits, token_mask)
        if all(_is_plain_greedy(row.params) for row in rows):
            return self._result(logits.argmax(dim=-1), rows, None)
        raw_logprobs = None
        if any(row.params.logprobs is not None for row in rows):
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        processed = logits.to(torch.float32, copy=True)
        apply_logit_bias(processed, rows)
        apply_penalties(processed, rows)
        return self._result(self._choose(processed, rows), rows, raw_logprobs)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not is_greedy(row.params)]
        if not random_rows:
            return chosen
        if len(random_rows) == len(rows):
            return self._sample_random(logits, rows)
        index = _index(random_rows, logits)
        sampled = self._sample_random(logits[index], [rows[i] for i in random_rows])
        return chosen.index_copy_(0, index, sampled)

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        temperatures = _column([row.params.temperature for row in rows], logits)
        logits = _filter(logits.div_(temperatures), [row.params for row in rows])
        probs = torch.softmax(logits, dim=-1)
        return probs.div_(self._exponential_noise(probs, rows)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self._default_generator(probs.device))
        elif unseeded:
            shared = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
            noise[_index(unseeded, probs)] = shared.exponential_(generator=self._default_generator(probs.device))
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)  # this row's draws depend on its seed only
        return noise.clamp_(min=_TINY)

    def skip(self, generator: torch.Generator, params: SamplingParams, samples: int) -> None:
        """Advances a row's own generator past `samples` picks, as if this sampler had made them:
        a completion resumed here continues the random stream its seed gives."""
        if is_greedy(params):
            return  # greedy rows draw nothing
        for _ in range(samples):
            torch.empty(self.vocab_size, device=generator.device).exponential_(generator=generator)

    def _default_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = make_generator(self._seed, device)
        return self._generators[device]

    def _result(self, chosen: torch.Tensor, rows: Sequence[SamplingRow],
                raw_logprobs: torch.Tensor | None) -> SampleResult:
        if raw_logprobs is None:
            return SampleResult(chosen.tolist(), [None] * len(rows), chosen)
        token_ids, logprobs = self._logprobs(raw_logprobs, chosen, rows)
        return SampleResult(token_ids, logprobs, chosen)

    def _logprobs(self, raw: torch.Tensor, chosen: torch.Tensor,
                  rows: Sequence[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """The ids and their logprobs in one read from the device: [id, its logprob, top k logprobs,
        top k ids] per row."""
        want = [row.params.logprobs for row in rows]
        k = max(n for n in want if n is not None)
        top_lp, top_ids = raw.topk(k, dim=-1)
        table = read_rows([chosen.unsqueeze(1), raw.gather(1, chosen.unsqueeze(1)), top_lp, top_ids])
        token_ids = [int(r[0]) for r in table]
        return token_ids, [None if n is None else self._token_logprob(
            token_ids[i], table[i][1], [int(t) for t in table[i][2 + k:2 + k + n]], table[i][2:2 + n])
            for i, n in enumerate(want)]

    def _token_logprob(self, token_id: int, logprob: float, top_ids: list[int], top_lp: list[float]) -> TokenLogprob:
        top = tuple((t, self._token_text(t), lp) for t, lp in zip(top_ids, top_lp))
        return TokenLogprob(token_id, self._token_text(token_id), logprob, top)


def _is_plain_greedy(params: SamplingParams) -> bool:
    return is_greedy(params) and not _has_penalties(params) and not params.logit_bias and params.logprobs is None


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """[M, 1] float32 tensor on like's device (one small host-to-device copy)."""
    return host_to_device(list(values), torch.float32, like.device).unsqueeze(1)


def _index(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """An int64 index on like's device (a pinned copy: a pageable one would wait for the GPU)."""
    return host_to_device(list(values), torch.long, like.device)


def _apply(logits: torch.Tensor, mask: TokenMask) -> None:
    """In place, before anything reads the logits: logprobs see the constrained distribution. Both copies
    are queued without a sync; the pinned words are not rewritten before this step's tokens are read."""
    pairs = host_to_device(mask.pairs, torch.int32, logits.device)
    with torch.inference_mode():  # the runner's logits are inference tensors
        apply_token_mask(logits, pairs, mask.words.to(logits.device, non_blocking=True))


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Adds each row's logit_bias to logits [M, V] float32, in place."""
    entries = [(i, t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias.items()]
    if not entries:
        return
    row_idx, token_idx, bias = zip(*entries)
    index = host_to_device([row_idx, token_idx], torch.long, logits.device)
    logits.index_put_((index[0], index[1]), host_to_device(bias, torch.float32, logits.device), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties of each row, in place on logits [M, V] float32."""
    penalised = [i for i, row in enumerate(rows) if _has_penalties(row.params)]
    if not penalised:
        return
    params = [rows[i].params for i in penalised]
    index = _index(penalised, logits)
    sub = logits[index]
    counts = _token_counts([rows[i].output_ids for i in penalised], sub)
    if any(p.repetition_penalty != 1.0 for p in params):
        sub = _repetition_penalty(sub, counts, [rows[i].prompt_ids for i in penalised], params)
    sub -= _column([p.frequency_penalty for p in params], sub) * counts
    sub -= _column([p.presence_penalty for p in params], sub) * (counts > 0)
    logits[index] = sub


def _repetition_penalty(logits: torch.Tensor, output_counts: torch.Tensor, prompt_ids: Sequence[Sequence[int]],
                        params: Sequence[SamplingParams]) -> torch.Tensor:
    """Every id seen in the prompt or the output: logit / r if positive, logit * r otherwise."""
    seen = (output_counts > 0) | (_token_counts(prompt_ids, logits) > 0)
    penalty = _column([p.repetition_penalty for p in params], logits)
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def _token_counts(id_lists: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
    """[m, V] float32: how often each id occurs in each row's list (ids outside [0, V) ignored)."""
    counts = torch.zeros_like(like)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), torch.tensor([len(ids) for ids in id_lists]))
    ids = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.int64)
    keep = (ids >= 0) & (ids < like.shape[1])
    index = tuple(host_to_device(t[keep], torch.long, like.device) for t in (rows, ids))
    counts.index_put_(index, torch.ones(index[0].shape, device=like.device), accumulate=True)
    return counts


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """min_p, then top_k, then top_p; filtered-out logits become -inf. Sorts at most once."""
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        threshold = _column([p.min_p for p in params], logits) * probs.max(dim=-1, keepdim=True).values
        logits.masked_fill_(probs < threshold, float("-inf"))
    top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < logits.shape[1] or min(top_p) < 1.0:
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the kept tail is at the right
    kth_index = _index([vocab - min(k, vocab) for k in top_k], logits).unsqueeze(1)
    kth_value = sorted_logits.gather(1, kth_index)
    sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))  # ties with the k-th are kept
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - _column(top_p, logits)  # the smallest tokens holding at most 1 - p
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)
