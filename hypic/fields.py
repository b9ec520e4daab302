"""Checks of a frozen dataclass's fields against their annotations and rules, every problem at once.

A value must have its annotated type (bool is not an int; an int is a float; `X | None`,
`Literal[...]`, `tuple[T, ...]` and `dict[K, V]` are checked element by element); a field with a
`Rule` must then also pass the rule. Nothing is converted: callers normalise first.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from hypic.errors import FieldProblem, InvalidFieldsError

_NAMES: dict[object, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                             dict: "a dict", type(None): "None"}


@dataclasses.dataclass(frozen=True)
class Rule:
    ok: Callable[[Any], bool]
    """Called only on a value of the field's type."""
    allowed: str
    """The whole of what the field takes, type included: "an integer >= 1"."""


def check_fields(obj: Any, rules: Mapping[str, Rule]) -> None:
    """Raises InvalidFieldsError naming each field of the dataclass `obj` that is wrong."""
    hints = _hints(type(obj))
    found = (_problem(f.name, getattr(obj, f.name), hints[f.name], rules.get(f.name)) for f in dataclasses.fields(obj))
    problems = [problem for problem in found if problem is not None]
    if problems:
        raise InvalidFieldsError(type(obj).__name__, problems)


def _problem(name: str, value: Any, hint: Any, rule: Rule | None) -> FieldProblem | None:
    if conforms(value, hint) and (rule is None or rule.ok(value)):
        return None
    return FieldProblem(name, value, rule.allowed if rule is not None else describe(hint))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def conforms(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(conforms(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return hint is Any or isinstance(value, hint)


def describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is tuple:
        return f"a tuple, each {describe(args[0])}"
    if origin is dict:
        return f"a dict of {describe(args[0])} -> {describe(args[1])}"
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))
