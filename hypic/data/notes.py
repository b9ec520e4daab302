"""A consistent little world (people, cities, companies) written out as notes of filler and facts.

Every fact is stated once, so any subset of the notes, in any order, never contradicts itself.
Notes come in units: a unit is one note, an (anchor, dependent) pair whose second note says "The person
above ..." (a linked note) and is only meaningful right after its anchor, or the two segments of a long
note cut inside a fact; units are never split.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import hypic.data.lexicon as lexicon

RELATIONS: tuple[str, ...] = ("lives", "job", "code", "based")
"""Relations of a random fact sentence; "based" ("Oslo hosts Acme.") answers no lookup itself."""
PRACTICE_RELATIONS: tuple[str, ...] = ("hosts",)
"""Relations only training practice draws: "hosts" is a based fact asked by its city ("Which company is
based in Oslo?"), a two-hop question's second hop on its own."""

CHARS_PER_TOKEN = 4.7
"""Average characters per token of the bundled tokenizer on notes (used to size notes)."""


@dataclass(frozen=True)
class Candidate:
    """An answerable question: its kind, text, answer, the notes it needs (indices) and its evidence,
    the note sentences the answer rests on, as they are written there."""

    kind: str
    question: str
    answer: str
    notes: tuple[int, ...]
    evidence: str


@dataclass
class Note:
    text: str = ""
    lives: dict[str, str] = field(default_factory=dict)   # person -> city stated here
    based: dict[str, str] = field(default_factory=dict)   # city -> company stated here
    candidates: list[Candidate] = field(default_factory=list)


class World:
    """Draws unique entities; `rich` swaps single-token names for multi-token invented ones."""

    def __init__(self, rng: random.Random, rich: bool) -> None:
        self.rng, self.rich = rng, rich
        self._used: set[str] = set()

    def _unique(self, draw) -> str:
        for _ in range(1000):
            if (name := draw()) not in self._used:
                self._used.add(name)
                return name
        raise ValueError("entity space exhausted: use rich names or fewer notes")

    def person(self) -> str:
        if self.rich:
            return self._unique(lambda: f"{self.rng.choice(lexicon.FIRST_NAMES)} {lexicon.invented_word(self.rng)}")
        return self._unique(lambda: self.rng.choice(lexicon.FIRST_NAMES))

    def city(self) -> str:
        if self.rich:
            return self._unique(lambda: f"{lexicon.invented_word(self.rng)} {self.rng.choice(lexicon.RICH_CITY_SUFFIXES)}")
        return self._unique(lambda: self.rng.choice(lexicon.CITIES))

    def company(self) -> str:
        if self.rich:
            return self._unique(lambda: f"{lexicon.invented_word(self.rng)} {self.rng.choice(lexicon.RICH_COMPANY_SUFFIXES)}")
        return self._unique(lambda: self.rng.choice(lexicon.COMPANIES))

    def code(self) -> str:
        digits = 4 if self.rich else 3
        return self._unique(lambda: str(self.rng.randrange(10 ** (digits - 1), 10**digits)))

    def job(self) -> str:
        return self.rng.choice(lexicon.JOBS)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _lookup(note: Note, index: int, question: str, answer: str, sentence: str) -> str:
    """Records `sentence` as the evidence of a lookup candidate on `note` and returns it."""
    note.candidates.append(Candidate("lookup", question, answer, (index,), sentence))
    return sentence


def _lookup_fact(world: World, relation: str, person: str, city: str | None = None) -> tuple[str, str, str]:
    """(question, answer, head) of a "lives", "job" or "code" fact about `person`, written f"{head} {answer}."
    ("lives" takes `city` where a two-hop chain planted it, or draws one)."""
    if relation == "lives":
        return f"Where does {person} live?", city or world.city(), f"{person} lives in"
    if relation == "job":
        job = world.job()
        return f"What is {person}'s job?", job, f"{person} works as {_article(job)}"
    return f"What is {person}'s locker code?", world.code(), f"{person}'s locker code is"


def _fact(world: World, note: Note, index: int, relations: tuple[str, ...],
          chain: tuple[str, str] | None = None) -> str:
    """One fact sentence of a random relation about a fresh entity, recorded as a lookup candidate on `note`."""
    person, relation = world.person(), world.rng.choice(relations)
    city = None
    if chain is not None:  # a planted chain is the first hop of a two-hop: its city is stated in another note
        (person, city), relation = chain, "lives"
    if relation in ("lives", "job", "code"):
        question, answer, head = _lookup_fact(world, relation, person, city)
        if relation == "lives":
            note.lives[person] = answer
        return _lookup(note, index, question, answer, f"{head} {answer}.")
    city, company = world.city(), world.company()
    note.based[city] = company
    if relation == "hosts":
        return _lookup(note, index, f"Which company is based in {city}?", company, based_sentence(city, company))
    return based_sentence(city, company)


def lookup_relation(question: str) -> str:
    """The relation ("lives", "job", "code" or "hosts") a lookup question of `_fact` asks about."""
    if question.startswith("Where does"):
        return "lives"
    if question.startswith("Which company"):
        return "hosts"
    return "job" if question.endswith("job?") else "code"


def based_sentence(city: str, company: str) -> str:
    """City first, as the key a two-hop answer is found by: restating "Oslo hosts" copies the company
    that follows (induction), where "Acme is based in Oslo." would have to be read backwards."""
    return f"{city} hosts {company}."


def _fill(world: World, sentences: list[str], target_tokens: int, fixed_chars: int) -> list[str]:
    """Inserts filler sentences at random places until the note reaches about `target_tokens`."""
    out = list(sentences)
    chars = fixed_chars + sum(len(s) + 1 for s in out)
    while chars / CHARS_PER_TOKEN < target_tokens:
        sentence = lexicon.filler_sentence(world.rng)
        out.insert(world.rng.randint(0, len(out)), sentence)
        chars += len(sentence) + 1
    return out


def _finish(note: Note, body: list[str], signer: str) -> Note:
    note.text = "Note: " + " ".join(body) + f" Filed by {signer}.\n"
    return note


def fact_note(world: World, index: int, target_tokens: int, num_facts: int,
              chains: list[tuple[str, str]], bases: list[tuple[str, str]],
              relations: tuple[str, ...] = RELATIONS) -> Note:
    """Filler plus `num_facts` facts; `chains` (person, city) and `bases` (city, company) are planted,
    the others draw their relation from `relations`."""
    note = Note()
    facts = [_fact(world, note, index, relations, chain) for chain in chains]
    for city, company in bases:
        note.based[city] = company
        facts.append(based_sentence(city, company))
    facts += [_fact(world, note, index, relations) for _ in range(max(0, num_facts - len(facts)))]
    world.rng.shuffle(facts)
    return _finish(note, _fill(world, facts, target_tokens, 30), world.person())


def signer_of(note: Note) -> str:
    return note.text.rsplit(" Filed by ", 1)[1][:-2]


def dependent_note(world: World, index: int, anchor: int, notes: list[Note], target_tokens: int) -> Note:
    """A note that starts "The person above works at X": X employs the signer of notes[anchor]."""
    note, company = Note(), world.company()
    person = signer_of(notes[anchor])
    opening = f"The person above works at {company}."
    note.candidates.append(Candidate("linked", f"Where does {person} work?", company, (anchor, index),
                                     f"Filed by {person}. {opening}"))
    return _finish(note, [opening] + _fill(world, [], target_tokens, 60), world.person())


def long_note(world: World, index: int, target_tokens: int) -> tuple[Note, Note]:
    """A long note cut into two segments inside a fact, right before its value ("Derek's locker code is" |
    " 4821. ..."), as a chunker cuts a document at a size, not at a sentence: the value's meaning sits in
    the segment before it, so a value prefilled in isolation is nobody's. The cut falls at a random depth."""
    first, second = Note(), Note()  # the question rests on both: its candidate sits on the second
    person = world.person()
    question, value, head = _lookup_fact(world, world.rng.choice(("lives", "job", "code")), person)
    fact = f"{head} {value}."
    body = _fill(world, [], target_tokens, 30 + len(fact))
    body.insert(world.rng.randint(len(body) // 4, (3 * len(body)) // 4), fact)
    text = _finish(Note(), body, world.person()).text
    cut = text.index(fact) + len(head)
    first.text, second.text = text[:cut], text[cut:]
    second.candidates.append(Candidate("long", question, value, (index, index + 1), fact))
    return first, second
