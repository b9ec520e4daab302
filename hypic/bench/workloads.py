"""What `hypic bench serve` sends: seeded RAG and chat workloads, and traces replayed from JSONL.

Every request is kept both as segment texts and as the token ids of each segment, tokenized once on
the client exactly as hypic's server tokenizes segments (`encode_segments`), so a server with PIC
(segments of ids) and one without (one id list, their concatenation) see the same tokens.
"""
from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hypic.data.lexicon import filler_sentence
from hypic.engine.pic.segments import encode_segments
from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError

Segments = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class BenchRequest:
    """One request: its segments (prefix, PIC segments..., query) as ids and, where known, as text."""

    segments: Segments
    texts: tuple[str, ...] | None  # None: a trace gave the segments as ids
    max_tokens: int
    messages: tuple[dict, ...] | None = None  # a trace's chat messages: sent as text to /v1/chat/completions
    after: int | None = None  # the index (in its stream) of the request that must finish first: a previous turn
    arrival_s: float | None = None  # a trace's arrival time
    cold_segments: int = 0  # documents no earlier request had (rag with cold_fraction > 0)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The prompt as one id list (what a server without PIC gets)."""
        return tuple(itertools.chain.from_iterable(self.segments))


@dataclass(frozen=True)
class RagSpec:
    """A corpus of `documents` documents (lengths uniform in doc_tokens·(1 ± doc_tokens_range)),
    drawn with Zipf(zipf_s) popularity, docs_per_request of them per request in random order, after
    a fixed system prompt and before a new question. Each document is, with probability
    cold_fraction, replaced by a new one that no request had (a cache miss)."""

    documents: int = 100
    doc_tokens: int = 1500
    doc_tokens_range: float = 0.2
    docs_per_request: int = 8
    zipf_s: float = 1.0
    system_tokens: int = 64
    question_tokens: int = 24
    max_tokens: int = 32
    seed: int = 0
    cold_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.docs_per_request <= self.documents:
            raise InvalidRequestError(
                f"docs per request must be in [1, {self.documents}] (the corpus size); got {self.docs_per_request}")
        if not 0 <= self.doc_tokens_range < 1:
            raise InvalidRequestError(f"the document length range must be in [0, 1); got {self.doc_tokens_range}")
        if not 0 <= self.cold_fraction <= 1:
            raise InvalidRequestError(f"the cold fraction must be in [0, 1]; got {self.cold_fraction}")


@dataclass(frozen=True)
class ChatSpec:
    """`conversations` conversations in flight at once, each `turns` turns long; every turn resends
    the system prompt and the earlier turns (one segment each, a fixed synthetic answer in each)."""

    conversations: int = 16
    turns: int = 4
    system_tokens: int = 64
    user_tokens: int = 48
    answer_tokens: int = 48
    max_tokens: int = 32
    seed: int = 0


class TextSource:
    """Seeded filler text of about a given number of tokens (counted with the model's tokenizer)."""

    def __init__(self, tokenizer: Tokenizer, seed: int | str) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def text(self, tokens: int) -> str:
        sentences: list[str] = []
        count = 0
        while count < tokens:
            sentence = filler_sentence(self.rng)
            count += len(self.tokenizer.encode(" " + sentence, add_special_tokens=False))
            sentences.append(sentence)
        return " ".join(sentences)


def request_from_texts(tokenizer: Tokenizer, texts: Sequence[str], max_tokens: int,
                       after: int | None = None) -> BenchRequest:
    segments = tuple(tuple(ids) for ids in encode_segments(tokenizer, texts))
    return BenchRequest(segments, tuple(texts), max_tokens, after=after)


def stream_seed(seed: int, key: str, role: int) -> str:
    """The seed of one random source (`role`) of the request stream `key` (a rate point, the warm-up):
    each stream draws on its own, so a point's requests do not depend on the points before it."""
    return f"{seed}/{key}/{role}"


def zipf_weights(count: int, s: float) -> list[float]:
    """Popularity of ranks 1..count under Zipf(s), normalised (rank 1 = document 0)."""
    raw = [rank ** -s for rank in range(1, count + 1)]
    total = sum(raw)
    return [weight / total for weight in raw]


def pick_documents(rng: random.Random, cumulative: Sequence[float], k: int) -> list[int]:
    """k distinct documents by popularity (draws repeated until distinct), in random order."""
    chosen: list[int] = []
    while len(chosen) < k:
        index = rng.choices(range(len(cumulative)), cum_weights=cumulative)[0]
        if index not in chosen:
            chosen.append(index)
    rng.shuffle(chosen)
    return chosen


class RagWorkload:
    """The corpus (built once) and an endless, seeded stream of requests over it."""

    def __init__(self, tokenizer: Tokenizer, spec: RagSpec) -> None:
        self.tokenizer, self.spec = tokenizer, spec
        source = TextSource(tokenizer, spec.seed)
        self.system = source.text(spec.system_tokens)
        lengths = random.Random(spec.seed + 1)
        self.documents = [self._document(source, lengths) for _ in range(spec.documents)]

    def _document(self, source: TextSource, lengths: random.Random) -> str:
        spread = self.spec.doc_tokens * self.spec.doc_tokens_range
        return source.text(max(1, round(lengths.uniform(self.spec.doc_tokens - spread, self.spec.doc_tokens + spread))))

    def requests(self, key: str) -> Iterator[BenchRequest]:
        """The endless stream `key` (every stream over the same corpus)."""
        spec, tokenizer = self.spec, self.tokenizer
        rng, questions = random.Random(stream_seed(spec.seed, key, 2)), TextSource(tokenizer, stream_seed(spec.seed, key, 3))
        cold = random.Random(stream_seed(spec.seed, key, 4))
        cold_source = TextSource(tokenizer, stream_seed(spec.seed, key, 5))
        cumulative = list(itertools.accumulate(zipf_weights(spec.documents, spec.zipf_s)))
        while True:
            docs = [self.documents[i] for i in pick_documents(rng, cumulative, spec.docs_per_request)]
            misses = [i for i in range(len(docs)) if cold.random() < spec.cold_fraction]
            for i in misses:
                docs[i] = self._document(cold_source, cold)
            texts = [self.system, *docs, questions.text(spec.question_tokens) + " Question:"]
            request = request_from_texts(self.tokenizer, texts, spec.max_tokens)
            yield replace(request, cold_segments=len(misses)) if misses else request

    def preheat(self) -> list[BenchRequest]:
        """One request per document (system prompt, the document, no question): fills the caches."""
        return [request_from_texts(self.tokenizer, [self.system, doc, ""], 1) for doc in self.documents]


class ChatWorkload:
    """An endless, seeded stream of turns of interleaved conversations; a turn waits for the previous one."""

    def __init__(self, tokenizer: Tokenizer, spec: ChatSpec) -> None:
        self.tokenizer, self.spec = tokenizer, spec
        self.system = TextSource(tokenizer, spec.seed).text(spec.system_tokens)

    def requests(self, key: str) -> Iterator[BenchRequest]:
        """The endless stream `key`: its conversations start with it, `after` counts in it."""
        spec, rng = self.spec, random.Random(stream_seed(self.spec.seed, key, 1))
        source = TextSource(self.tokenizer, stream_seed(spec.seed, key, 2))
        active: list[tuple[list[str], int | None]] = [([], None) for _ in range(spec.conversations)]
        for index in itertools.count():
            slot = rng.randrange(len(active))
            history, previous = active[slot]
            user = "User: " + source.text(spec.user_tokens) + "\nAssistant:"
            yield request_from_texts(self.tokenizer, [self.system, *history, user], spec.max_tokens, previous)
            history = [*history, f"{user} {source.text(spec.answer_tokens)}\n"]
            active[slot] = ([], None) if len(history) == spec.turns else (history, index)

    def preheat(self) -> list[BenchRequest]:
        return []


class TraceWorkload:
    """Requests read from a JSONL file: one JSON object a line with `timestamp` (seconds),
    `max_tokens` and one of `segments` (texts, or token-id lists) or `messages` (chat)."""

    def __init__(self, tokenizer: Tokenizer, path: Path) -> None:
        self.path = path
        lines = path.read_text().splitlines()
        self.items = [_trace_request(tokenizer, line, number, path)
                      for number, line in enumerate(lines, 1) if line.strip()]
        if not self.items:
            raise InvalidRequestError(f"the trace {path} has no requests")

    def requests(self, key: str) -> Iterator[BenchRequest]:
        """The whole trace, whatever the stream."""
        return iter(self.items)

    def preheat(self) -> list[BenchRequest]:
        return []


def _trace_request(tokenizer: Tokenizer, line: str, number: int, path: Path) -> BenchRequest:
    where = f"{path}:{number}"
    try:
        item = json.loads(line)
        timestamp, max_tokens = float(item["timestamp"]), int(item["max_tokens"])
    except (ValueError, KeyError, TypeError) as error:
        raise InvalidRequestError(f"{where}: a trace line is a JSON object with timestamp and max_tokens ({error})")
    if "messages" in item:
        return BenchRequest((), None, max_tokens, messages=tuple(item["messages"]), arrival_s=timestamp)
    segments = item.get("segments")
    if not segments or not (all(isinstance(s, str) for s in segments) or all(isinstance(s, list) for s in segments)):
        raise InvalidRequestError(f"{where}: segments must be a non-empty list of texts or of token-id lists")
    if isinstance(segments[0], str):
        request = request_from_texts(tokenizer, segments, max_tokens)
        return BenchRequest(request.segments, request.texts, max_tokens, arrival_s=timestamp)
    return BenchRequest(tuple(tuple(s) for s in segments), None, max_tokens, arrival_s=timestamp)
