"""Typed errors across processes: what a node raised is raised again, same class, in the router."""
from __future__ import annotations

from hypic import errors
from hypic.dist.messages import ErrorInfo

_TYPED: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, Exception)
}


def error_info(error: BaseException) -> ErrorInfo:
    fields: dict[str, int | float | str] = {}
    if isinstance(error, errors.PromptTooLongError):
        fields = dict(prompt_tokens=error.prompt_tokens, max_model_len=error.max_model_len,
                      max_tokens=error.max_tokens)
    elif isinstance(error, errors.EngineOverloadedError):
        fields = dict(waiting=error.waiting, limit=error.limit, retry_after=error.retry_after)
    elif isinstance(error, errors.StepOutOfMemoryError):
        known = dict(asked_bytes=error.asked_bytes, free_bytes=error.free_bytes)
        fields = dict(step_tokens=error.step_tokens, step_requests=error.step_requests, retry_after=error.retry_after,
                      **{name: value for name, value in known.items() if value is not None})
    return ErrorInfo(type(error).__name__, str(error), fields)


def raise_remote(info: ErrorInfo, node: str) -> None:
    """Raise the error a node reported: hypic's own classes as themselves, anything else (a bug on
    that node) as EngineDeadError naming the node."""
    cls = _TYPED.get(info.kind)
    f = info.fields
    if cls is errors.PromptTooLongError:
        raise errors.PromptTooLongError(int(f["prompt_tokens"]), int(f["max_model_len"]), int(f["max_tokens"]))
    if cls is errors.EngineOverloadedError:
        raise errors.EngineOverloadedError(int(f["waiting"]), int(f["limit"]), float(f["retry_after"]))
    if cls is errors.StepOutOfMemoryError:
        raise errors.StepOutOfMemoryError(int(f["step_tokens"]), int(f["step_requests"]), _optional(f, "asked_bytes"),
                                          _optional(f, "free_bytes"), float(f["retry_after"]))
    if cls is not None:
        raise cls(info.message)
    raise errors.EngineDeadError(f"engine node {node} failed: {info.kind}: {info.message}")


def _optional(fields: dict[str, int | float | str], name: str) -> int | None:
    return int(fields[name]) if name in fields else None
