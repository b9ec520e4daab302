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
    found = (_problem(name, getattr(obj, name), hint, rules.get(name)) for name, hint in _hints(type(obj)))
    problems = [problem for problem in found if problem is not None]
    if problems:
        raise InvalidFieldsError(type(obj).__name__, problems)


def _problem(name: str, value: Any, hint: Any, rule: Rule | None) -> FieldProblem | None:
    if conforms(value, hint) and (rule is None or rule.ok(value)):
        return None
    return FieldProblem(name, value, rule.allowed if rule is not None else describe(hint))


@functools.cache
def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def conforms(value: Any, hint: Any) -> bool:
    return _checker(hint)(value)


@functools.cache
def _checker(hint: Any) -> Callable[[Any], bool]:
    """A predicate for one annotation, built once (typing's introspection is slow per call)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = tuple(map(_checker, args))
        return lambda v: any(check(v) for check in options)
    if origin is typing.Literal:
        return lambda v: any(v == arg and type(v) is type(arg) for arg in args)
    if origin is tuple:
        item = _checker(args[0])
        return lambda v: isinstance(v, tuple) and all(map(item, v))
    if origin is dict:
        key, value = _checker(args[0]), _checker(args[1])
        return lambda v: isinstance(v, dict) and all(key(k) and value(x) for k, x in v.items())
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    return (lambda v: True) if hint is Any else (lambda v: isinstance(v, hint))


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
