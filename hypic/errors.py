"""Typed errors. Every message says what was wrong and what the user can do about it."""
from __future__ import annotations

import reprlib
from collections.abc import Iterable
from dataclasses import dataclass


class HypicError(Exception):
    """Base class of every error hypic raises on purpose."""


class InvalidRequestError(HypicError, ValueError):
    """The request itself is malformed (bad sampling values, empty prompt, ...)."""


@dataclass(frozen=True)
class FieldProblem:
    """One field of a config or request whose value has the wrong type or is out of range."""

    field: str
    value: object
    allowed: str  # what the field takes, e.g. "a number in (0, 1]"

    def __str__(self) -> str:
        return f"{self.field} must be {self.allowed}, got {reprlib.repr(self.value)}"


class InvalidFieldsError(InvalidRequestError):
    """Every bad field of one config or request at once; the message starts with the first field's name."""

    def __init__(self, owner: str, problems: Iterable[FieldProblem]) -> None:
        self.owner, self.problems = owner, tuple(problems)
        super().__init__("; ".join(map(str, self.problems)) + f" ({owner})")


class PromptTooLongError(InvalidRequestError):
    def __init__(self, prompt_tokens: int, max_model_len: int, max_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        extra = f" plus max_tokens={max_tokens}" if max_tokens else ""
        super().__init__(
            f"prompt has {prompt_tokens} tokens{extra}, more than the model's context of "
            f"{max_model_len} tokens; shorten the prompt or lower max_tokens"
        )


class UnsupportedModelError(HypicError):
    """The checkpoint's architecture or format is not one hypic serves."""


class OutOfMemoryError(HypicError):
    """The memory budget cannot hold even one request of the configured context."""


class EngineDeadError(HypicError):
    """The engine loop died; every pending request fails with this error."""


class EngineOverloadedError(HypicError):
    """The waiting queue is full; retry after `retry_after` seconds."""

    def __init__(self, waiting: int, limit: int, retry_after: float = 1.0) -> None:
        self.waiting, self.limit, self.retry_after = waiting, limit, retry_after
        super().__init__(f"{waiting} requests are waiting (limit {limit}); retry in {retry_after:g} s")


class StepOutOfMemoryError(HypicError):
    """The device ran out of memory in one engine step. Only the requests in that step fail (with
    this error; retry them after `retry_after` seconds); the engine goes on serving the others."""

    def __init__(self, step_tokens: int, step_requests: int, asked_bytes: int | None, free_bytes: int | None,
                 retry_after: float = 1.0) -> None:
        self.step_tokens, self.step_requests = step_tokens, step_requests
        self.asked_bytes, self.free_bytes, self.retry_after = asked_bytes, free_bytes, retry_after
        asked = "" if asked_bytes is None else f", asking {_mib(asked_bytes)}"
        free = "" if free_bytes is None else f" with {_mib(free_bytes)} free"
        super().__init__(
            f"the device ran out of memory in an engine step of {step_tokens} tokens and {step_requests} "
            f"requests{asked}{free}; the engine goes on serving: retry in {retry_after:g} s (if it recurs, "
            "lower max_num_batched_tokens or gpu_memory_utilization)")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
