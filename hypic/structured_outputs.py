"""What a constrained request's output must match: a JSON schema, a regex, a choice or a grammar.

The grammar is llguidance's; it is checked (without a tokenizer) when the request is built, so a
schema the library cannot compile is refused before anything is queued. JSON is generated without
free whitespace (compact separators), so a weak model cannot loop on blanks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import llguidance

from hypic.errors import InvalidRequestError

GrammarKind = Literal["json", "regex", "choice", "lark"]  # "lark" takes GBNF too (converted)
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class StructuredOutputs:
    """kind + text: a JSON schema (as JSON text), a regex, a JSON list of choices, or Lark/GBNF.

    lenient: ignore JSON-schema keywords llguidance does not implement (OpenAI's strict=false);
    otherwise such a keyword is an error. after: the constraint starts once this text has been
    generated (the end of a reasoning block); before it the model writes freely."""

    kind: GrammarKind
    text: str
    lenient: bool = False
    after: str | None = None

    def __post_init__(self) -> None:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.grammar())
        if is_error:
            raise InvalidRequestError(f"structured output: the {self.kind} constraint does not compile: {messages[0]}")

    def grammar(self) -> str:
        """The llguidance grammar (a JSON text) this constraint compiles to."""
        if self.kind == "json":
            options = {**_COMPACT, "lenient": self.lenient}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(self.text, overrides=options)
            except ValueError as error:
                raise InvalidRequestError(f"structured output: the JSON schema is not a JSON object: {error}") from None
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.text)
        return llguidance.grammar_from("regex" if self.kind == "regex" else "grammar", self.text)
