"""RAG-shaped question answering over notes, laid out for position-independent caching.

A prompt is `separator.join(segments)`: segment 0 is the chat prefix (system message and the start
of the user turn), then one segment per note, then the query segment (the question and the start of
the assistant turn). The text equals the ChatML rendering of `chat_messages()`, separators included,
so the same prompt can be sent raw or through a chat template. The model replies "Answer: <answer>",
or, with `TaskSpec.restate`, first restates the note sentences the answer rests on ("Note: Derek
lives in Oslo. Answer: Oslo"): the value then follows the same tokens as in the note, which a copying
(induction) head can retrieve, where a bare answer has to bind the name to its value in one step.

Question kinds, reported separately:
- lookup:  a fact stated in one note ("Derek lives in Oslo.").
- two_hop: "Derek lives in Oslo." and "Oslo hosts Acme." in two notes, any order.
- linked:  a note says "The person above works at Acme."; the person is the signer of the note
           placed right before it, so isolated prefill of the second note cannot resolve it.
- long:    a long note (the longest of the prompt) cut into two segments inside a fact, right before its
           value ("Derek's locker code is" | " 4821. ..."), as a size-based chunker cuts a document: in
           full recompute it is an ordinary lookup; a value prefilled in isolation belongs to nobody,
           and a seam window of a few tokens repairs it.
A linked or long question comes with RIVAL_UNITS other pairs or long notes where the notes allow (with
`TaskSpec.strict_rivals`, always), so that the answer is never the only "works at" sentence (or cut
note) in sight.

Everything is a pure function of (spec, split, seed, index): the same call gives the same prompt
in any process. Splits draw from disjoint seed streams.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

from hypic.config import PIC_SEPARATOR
from hypic.data.notes import (PRACTICE_RELATIONS, RELATIONS, Candidate, Note, World, based_sentence,
                              dependent_note, fact_note, long_note)

KINDS: tuple[str, ...] = ("lookup", "two_hop", "linked", "long")
RIVAL_KINDS: tuple[str, ...] = ("linked", "long")  # kinds whose own structure (a two-note unit) gets rivals
RIVAL_UNITS = 2  # other pairs / long notes beside such a question's own
POOL_REQUESTS = 5  # benchmark requests of each kind per note pool (see eval_prompts)
SPLITS: tuple[str, ...] = ("train", "validation", "test")
SYSTEM_PROMPT = "Read the notes and answer the question. Reply in the form 'Answer: ...'."
ANSWER_PREFIX = "Answer:"
EVIDENCE_PREFIX = "Note:"  # so the restated sentence's first word is tokenized as in the notes (after a space)
PREFIX_SEGMENT = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"


@dataclass(frozen=True)
class TaskSpec:
    """Shape of the prompts: how many notes, how long, which question kinds, which names."""

    min_notes: int = 4
    max_notes: int = 8
    min_note_tokens: int = 64
    max_note_tokens: int = 256
    kind_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    """Weights of KINDS, in that order."""
    rich_names: bool = True
    """Multi-token invented names (True) or single-token common words (False)."""
    questions: int = 1
    """Questions per prompt: the first sits in the query segment, the rest follow as chat turns."""
    facts_per_note: tuple[int, int] = (1, 3)
    """Fewest and most fact sentences in an ordinary note (planted two-hop facts included)."""
    relations: tuple[str, ...] = RELATIONS
    """Relations the random (not planted) facts draw from (RELATIONS, or PRACTICE_RELATIONS for practice);
    a repeated relation is drawn more often."""
    restate: bool = False
    """Replies restate their evidence before "Answer:" (the reply format the model is trained on)."""
    strict_rivals: bool = False
    """A linked or long question is asked only among 1 + RIVAL_UNITS units of its structure, as in the
    benchmark; otherwise rivals come as room permits, and a prompt crowded by several wanted kinds asks
    them beside no rival at all (stage 6 of training, 57 of 69 long questions: the model learned to copy
    the only locker code in sight, 0.94 there and 0.27 on the benchmark)."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_notes <= self.max_notes:
            raise ValueError(f"need 2 <= min_notes <= max_notes, got {self.min_notes}, {self.max_notes}")
        if not 0 < self.min_note_tokens <= self.max_note_tokens:
            raise ValueError("need 0 < min_note_tokens <= max_note_tokens")
        if len(self.kind_weights) != len(KINDS) or sum(self.kind_weights) <= 0:
            raise ValueError(f"kind_weights needs {len(KINDS)} non-negative weights, not all zero")
        if self.questions < 1:
            raise ValueError("questions must be >= 1")
        if not 1 <= self.facts_per_note[0] <= self.facts_per_note[1]:
            raise ValueError(f"need 1 <= fewest <= most facts_per_note, got {self.facts_per_note}")
        if not self.relations or not set(self.relations) <= set(RELATIONS + PRACTICE_RELATIONS):
            raise ValueError(f"relations must be a non-empty subset of {RELATIONS + PRACTICE_RELATIONS}, "
                             f"got {self.relations}")


EVAL_SPEC = TaskSpec(min_notes=4, max_notes=8, min_note_tokens=64, max_note_tokens=256, restate=True)
"""The held-out benchmark the bundled model is measured on (PIC accuracy per cache mode); the model
restates its evidence before the answer, and the text after "Answer:" is scored."""
EVAL_SPEC_SINGLE_NAMES = replace(EVAL_SPEC, rich_names=False)
"""The benchmark with single-token common names, the names of training stage 1."""


@dataclass(frozen=True)
class QA:
    question: str
    answer: str
    kind: str
    evidence: str = ""
    """Note sentences the reply restates before "Answer:" (empty: a bare answer)."""


@dataclass(frozen=True)
class Prompt:
    segments: tuple[str, ...]
    """Chat prefix, notes..., query segment (which holds qas[0].question)."""
    qas: tuple[QA, ...]

    @property
    def kind(self) -> str:
        return self.qas[0].kind

    @property
    def answer(self) -> str:
        return self.qas[0].answer

    @property
    def notes(self) -> tuple[str, ...]:
        return self.segments[1:-1]

    def text(self, separator: str = PIC_SEPARATOR) -> str:
        return separator.join(self.segments)

    def chat_messages(self, separator: str = PIC_SEPARATOR) -> list[dict[str, str]]:
        """System + user messages whose ChatML rendering (with generation prompt) is `text()`."""
        user = separator + separator.join(self.notes) + separator + f"Question: {self.qas[0].question}"
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def training_pieces(self) -> list[tuple[str, bool]]:
        """(text, supervised) pieces after the segments: each answer, then the next question turn."""
        pieces = [(reply_text(self.qas[0]), True)]
        for qa in self.qas[1:]:
            pieces += [(f"\n<|im_start|>user\nQuestion: {qa.question}<|im_end|>\n<|im_start|>assistant\n", False),
                       (reply_text(qa), True)]
        return pieces


def query_segment(question: str) -> str:
    return f"Question: {question}<|im_end|>\n<|im_start|>assistant\n"


def reply_text(qa: QA) -> str:
    """The supervised reply, ending with the end-of-turn token."""
    lead = f"{EVIDENCE_PREFIX} {qa.evidence} " if qa.evidence else ""
    return f"{lead}{ANSWER_PREFIX} {qa.answer}<|im_end|>"


def extract_answer(completion: str) -> str:
    """The answer inside a model reply: what follows its last "Answer:" ("Note: Derek lives in Oslo.
    Answer: Oslo" -> "Oslo"), or the whole reply when it has none."""
    text = completion.replace("<|im_end|>", "").strip()
    return text.rpartition(ANSWER_PREFIX)[2].strip()


def is_correct(completion: str, answer: str) -> bool:
    """Exact match of the extracted answer."""
    return extract_answer(completion) == answer


def _rng(split: str, seed: int, index: int, stream: str) -> random.Random:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return random.Random(f"hypic-notes:{stream}:{split}:{seed}:{index}")  # str seeds are process-stable


@dataclass(frozen=True)
class _Plan:
    pairs: int  # (anchor, linked note) pairs
    longs: int  # long notes, two segments each
    chains: int
    facts: int  # stand-alone fact notes (pair anchors are fact notes too)


def _plan(rng: random.Random, spec: TaskSpec, n: int, wanted: Counter) -> _Plan:
    """Structures for `n` notes serving the wanted question kinds: a wanted pair or long note comes
    with RIVAL_UNITS rivals, a kind not wanted often with one distractor (room permitting, or, with
    `spec.strict_rivals`, a wanted kind gets all of its rivals or no unit)."""
    on = dict(zip(KINDS, (w > 0 for w in spec.kind_weights)))
    extra = {kind: RIVAL_UNITS if wanted[kind] else int(on[kind] and rng.random() < 0.6) for kind in RIVAL_KINDS}
    if spec.strict_rivals:
        pairs, longs = _strict_units(rng, n, wanted, extra)
    else:
        pairs = min(wanted["linked"] + extra["linked"], n // 2)
        longs = min(wanted["long"] + extra["long"], (n - 2 * pairs) // 2)
    while n - pairs - longs < 2 and longs + pairs > 1:  # keep two notes beside the units' second notes
        longs, pairs = (longs - 1, pairs) if longs else (longs, pairs - 1)
    fact_like = n - pairs - 2 * longs  # fact notes and anchors: where two-hop facts can land
    chains = wanted["two_hop"] + (on["two_hop"] and rng.random() < 0.6) if fact_like >= 2 else 0
    return _Plan(pairs, longs, chains, n - 2 * pairs - 2 * longs)


def _strict_units(rng: random.Random, n: int, wanted: Counter, extra: dict[str, int]) -> tuple[int, int]:
    """(pairs, long notes) for `n` notes, the two kinds served in random order: a wanted kind takes
    1 + RIVAL_UNITS units (more if more questions want it) or none where they do not fit beside two
    fact-like notes (anchors count); a kind not wanted takes its distractor where it fits."""
    units = {"linked": 0, "long": 0}
    for kind in rng.sample(RIVAL_KINDS, len(RIVAL_KINDS)):
        trial = dict(units, **{kind: max(wanted[kind], 1 + RIVAL_UNITS) if wanted[kind] else extra[kind]})
        if 2 * (trial["linked"] + trial["long"]) <= n and n - trial["linked"] - trial["long"] >= 2:
            units = trial
    return units["linked"], units["long"]


def _lengths(rng: random.Random, spec: TaskSpec) -> tuple[int, int]:
    """Target tokens of an ordinary note and of a long note."""
    ordinary = rng.randint(spec.min_note_tokens, spec.max_note_tokens)
    long_min = max(spec.min_note_tokens, (3 * spec.max_note_tokens) // 4)
    return ordinary, rng.randint(long_min, spec.max_note_tokens)


def _build(world: World, spec: TaskSpec, plan: _Plan) -> tuple[list[Note], list[tuple[int, ...]]]:
    """All notes (indexed) and their units; fact notes first, so chain hops land in fact notes."""
    rng, n_fact_like = world.rng, plan.facts + plan.pairs
    chains: dict[int, list] = {i: [] for i in range(n_fact_like)}
    bases: dict[int, list] = {i: [] for i in range(n_fact_like)}
    for _ in range(plan.chains):
        i, j = rng.sample(range(n_fact_like), 2)
        city = world.city()
        chains[i].append((world.person(), city))
        bases[j].append((city, world.company()))
    notes = [fact_note(world, i, _lengths(rng, spec)[0], rng.randint(*spec.facts_per_note), chains[i], bases[i],
                       spec.relations) for i in range(n_fact_like)]
    units: list[tuple[int, ...]] = [(i,) for i in range(plan.facts)]
    for anchor in range(plan.facts, n_fact_like):
        notes.append(dependent_note(world, len(notes), anchor, notes, _lengths(rng, spec)[0]))
        units.append((anchor, len(notes) - 1))
    for _ in range(plan.longs):
        notes += long_note(world, len(notes), _lengths(rng, spec)[1])
        units.append((len(notes) - 2, len(notes) - 1))
    return notes, units


def _candidates(notes: list[Note], included: set[int]) -> list[Candidate]:
    """Every question answerable from the included notes."""
    found = [c for i in sorted(included) for c in notes[i].candidates if set(c.notes) <= included]
    for i in sorted(included):
        for person, city in notes[i].lives.items():
            for j in sorted(included - {i}):
                if city in notes[j].based:
                    company = notes[j].based[city]
                    evidence = f"{person} lives in {city}. {based_sentence(city, company)}"
                    found.append(Candidate("two_hop", f"Which company is based in the city where {person} lives?",
                                           company, (i, j), evidence))
    return found


def _qa(candidate: Candidate, restate: bool) -> QA:
    return QA(candidate.question, candidate.answer, candidate.kind, candidate.evidence if restate else "")


def _pick(rng: random.Random, candidates: list[Candidate], kinds: list[str], restate: bool) -> list[QA]:
    """One distinct candidate per wanted kind (any kind when that one has run out)."""
    pool, chosen = list(candidates), []
    for kind in kinds:
        if not pool:
            break
        of_kind = [c for c in pool if c.kind == kind] or pool
        choice = rng.choice(of_kind)
        pool.remove(choice)
        chosen.append(_qa(choice, restate))
    return chosen


def _assemble(rng: random.Random, notes: list[Note], units: list[tuple[int, ...]], qas: list[QA]) -> Prompt:
    order = list(units)
    rng.shuffle(order)
    texts = [notes[i].text for unit in order for i in unit]
    return Prompt((PREFIX_SEGMENT, *texts, query_segment(qas[0].question)), tuple(qas))


def make_prompt(spec: TaskSpec, split: str, index: int, seed: int = 0) -> Prompt:
    """Prompt `index` of `split`: a fresh world whose notes are all included, shuffled by unit."""
    rng = _rng(split, seed, index, "prompt")
    while True:  # a world without any question (only "Y hosts X" facts) is redrawn from the same rng
        kinds = rng.choices(KINDS, weights=spec.kind_weights, k=spec.questions)
        plan = _plan(rng, spec, rng.randint(spec.min_notes, spec.max_notes), Counter(kinds))
        notes, units = _build(World(rng, spec.rich_names), spec, plan)
        candidates = _candidates(notes, set(range(len(notes))))
        if spec.strict_rivals:  # a lone distractor pair or long note is read, never asked about
            structures = {"linked": plan.pairs, "long": plan.longs}
            candidates = [c for c in candidates if structures.get(c.kind, 1 + RIVAL_UNITS) > RIVAL_UNITS]
        qas = _pick(rng, candidates, kinds, spec.restate)
        if qas:
            return _assemble(rng, notes, units, qas)


def make_prompts(spec: TaskSpec, split: str, count: int, seed: int = 0) -> list[Prompt]:
    return [make_prompt(spec, split, i, seed) for i in range(count)]


class NotePool:
    """A fixed set of notes shared by many requests, so segments recur across requests (PIC reuse)."""

    def __init__(self, spec: TaskSpec, split: str, num_notes: int = 48, seed: int = 0, index: int = 0) -> None:
        rng = _rng(split, seed, num_notes, f"pool:{index}")
        plan = _Plan(pairs=num_notes // 8, longs=num_notes // 8, chains=num_notes // 4,
                     facts=num_notes - 4 * (num_notes // 8))
        self.spec, self.split, self.seed = spec, split, seed
        self.notes, self.units = _build(World(rng, spec.rich_names), spec, plan)
        self._candidates = _candidates(self.notes, set(range(len(self.notes))))
        self._structures = {unit: self._structure(unit) for unit in self.units}

    def request(self, index: int, kind: str) -> Prompt:
        """Request `index`: one question of `kind`, its supporting notes, distractors from the pool."""
        rng = _rng(self.split, self.seed, index, f"request:{kind}")
        target = rng.choice([c for c in self._candidates if c.kind == kind])
        chosen = [u for u in self.units if set(u) & set(target.notes)]
        rivals = [u for u in self.units if u not in chosen and self._structures[u] == kind] \
            if kind in RIVAL_KINDS else []
        for unit in rng.sample(rivals, len(rivals))[:RIVAL_UNITS]:
            if sum(map(len, chosen)) + len(unit) <= self.spec.max_notes:
                chosen.append(unit)
        n = max(rng.randint(self.spec.min_notes, self.spec.max_notes), sum(map(len, chosen)))
        for unit in rng.sample(self.units, len(self.units)):
            if unit not in chosen and sum(map(len, chosen)) + len(unit) <= n:
                chosen.append(unit)
        return _assemble(rng, self.notes, chosen, [_qa(target, self.spec.restate)])

    def _structure(self, unit: tuple[int, ...]) -> str:
        """The kind its second note answers ("linked" or "long") for a two-note unit, "lookup" for one note."""
        return self.notes[unit[1]].candidates[0].kind if len(unit) == 2 else "lookup"

    def requests(self, indices: range, kinds: tuple[str, ...] = KINDS) -> list[Prompt]:
        """Requests `indices` of each kind, kinds interleaved."""
        return [self.request(i, kind) for i in indices for kind in kinds]


def eval_prompts(per_kind: int, split: str = "test", spec: TaskSpec = EVAL_SPEC, seed: int = 0,
                 pool_notes: int | None = None) -> list[Prompt]:
    """The benchmark: `per_kind` requests of each question kind, POOL_REQUESTS of each kind per shared
    note pool, so notes recur across requests while the facts asked about vary (one pool's few pairs
    and long notes alone would make every linked or long question one of four). A pool holds 48
    notes, 32 with single-token names (their 118 first names run out in a larger one)."""
    num_notes = pool_notes or (48 if spec.rich_names else 32)
    prompts: list[Prompt] = []
    for pool, start in enumerate(range(0, per_kind, POOL_REQUESTS)):
        notes = NotePool(spec, split, num_notes, seed, pool)
        prompts += notes.requests(range(start, min(start + POOL_REQUESTS, per_kind)))
    return prompts
