"""A request's structured-output fields (OpenAI's response_format, vLLM's structured_outputs and
guided_*) -> the one StructuredOutputs constraint the engine applies. At most one may be set."""
from __future__ import annotations

import json
from collections.abc import Callable

from hypic.errors import InvalidRequestError
from hypic.serve.http_errors import bad_request
from hypic.serve.protocol import (JsonObjectFormat, JsonSchema, JsonSchemaResponseFormat, ResponseFormat,
                                  SamplingFields, StructuredOutputsField)
from hypic.structured_outputs import StructuredOutputs

Build = Callable[[], StructuredOutputs | None]


def requested_constraint(body: SamplingFields) -> StructuredOutputs | None:
    """Raises ApiError (400, naming the field) for two constraints or one that does not compile."""
    given = [(name, build) for name, build in _candidates(body) if build is not None]
    if len(given) > 1:
        raise bad_request(f"set one structured-output field, not {given[0][0]} and {given[1][0]}", given[1][0])
    if not given:
        return None
    name, build = given[0]
    try:
        return build()
    except InvalidRequestError as error:
        raise bad_request(str(error), name) from None


def _candidates(body: SamplingFields) -> list[tuple[str, Build | None]]:
    def text(kind: str, value: str | None) -> Build | None:
        return None if value is None else lambda: StructuredOutputs(kind, value)

    return [
        ("response_format", _response_format(body.response_format)),
        ("structured_outputs", _structured_outputs(body.structured_outputs)),
        ("guided_json", None if body.guided_json is None else lambda: _json(body.guided_json)),
        ("guided_regex", text("regex", body.guided_regex)),
        ("guided_choice", None if body.guided_choice is None else lambda: _choice(body.guided_choice)),
        ("guided_grammar", text("lark", body.guided_grammar)),
    ]


def _response_format(value: ResponseFormat | None) -> Build | None:
    if isinstance(value, JsonObjectFormat):
        return lambda: _json({"type": "object"})
    if isinstance(value, JsonSchemaResponseFormat):
        spec = value.json_schema
        return lambda: _json(spec.schema, lenient=not spec.strict)
    return None  # absent, or {"type": "text"}


def _structured_outputs(value: StructuredOutputsField | None) -> Build | None:
    if value is None:
        return None
    options = {
        "json": None if value.json is None else lambda: _json(value.json),
        "regex": None if value.regex is None else lambda: StructuredOutputs("regex", value.regex),
        "choice": None if value.choice is None else lambda: _choice(value.choice),
        "grammar": None if value.grammar is None else lambda: StructuredOutputs("lark", value.grammar),
        "json_object": (lambda: _json({"type": "object"})) if value.json_object else None,
    }
    chosen = [build for build in options.values() if build is not None]
    if len(chosen) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {sorted(options)}", "structured_outputs")
    return chosen[0]


def _json(schema: JsonSchema | str, *, lenient: bool = False) -> StructuredOutputs:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return StructuredOutputs("json", text, lenient)


def _choice(choices: list[str]) -> StructuredOutputs:
    if not choices:
        raise InvalidRequestError("the list of choices is empty")
    return StructuredOutputs("choice", json.dumps(choices))
