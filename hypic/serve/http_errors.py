"""Every failure the HTTP layer can report, as an OpenAI-style JSON error with its status."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
from aiohttp import web

from hypic.errors import (
    EngineDeadError,
    EngineOverloadedError,
    HypicError,
    InvalidRequestError,
    PromptTooLongError,
    StepOutOfMemoryError,
)
from hypic.serve.protocol import ErrorBody, ErrorDetail, encoder

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error answered to the client as is."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> web.Response:
        detail = ErrorDetail(self.message, _STATUS_TYPES.get(self.status, "error"), self.param, self.code)
        return web.Response(
            status=self.status,
            body=encoder.encode(ErrorBody(detail)),
            content_type="application/json",
            headers=self.headers,
        )

    def sse_event(self) -> bytes:
        detail = ErrorDetail(self.message, _STATUS_TYPES.get(self.status, "error"), self.param, self.code)
        return b"data: " + encoder.encode(ErrorBody(detail)) + b"\n\n"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_body_error(error: msgspec.MsgspecError) -> ApiError:
    """A 400 for JSON that does not parse or does not match the schema, naming the field."""
    if isinstance(error, msgspec.ValidationError):  # a subclass of DecodeError: test it first
        field = _field_of(str(error))
        if "unknown field" in str(error):
            return bad_request(f"unknown parameter {field!r}: hypic does not implement it; remove it", field)
        return bad_request(f"invalid request body: {error}", field)
    return bad_request(f"request body is not valid JSON: {error}")


def _field_of(message: str) -> str | None:
    """'Expected `int` ... - at `$.messages[0].role`' -> 'messages[0].role'; unknown fields likewise."""
    path_match = re.search(r" - at `\$\.?(.*)`$", message)
    path = path_match.group(1) if path_match else ""
    unknown = re.search(r"(?:unknown|missing required) field `([^`]*)`", message)
    if unknown:
        return f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    return path or None


def from_engine_error(error: HypicError, param_names: dict[str, str]) -> ApiError:
    """Map a typed engine error to its status. `param_names` maps engine field names to this API's."""
    if isinstance(error, PromptTooLongError):
        return ApiError(400, str(error), "prompt", "context_length_exceeded")
    if isinstance(error, InvalidRequestError):
        first_word = str(error).split(" ", 1)[0]  # SamplingParams messages start with the field name
        return bad_request(str(error), param_names.get(first_word))
    if isinstance(error, EngineOverloadedError):
        return ApiError(503, f"server overloaded: {error}", code="overloaded", headers=_retry_after(error.retry_after))
    if isinstance(error, StepOutOfMemoryError):
        return ApiError(503, str(error), code="step_out_of_memory", headers=_retry_after(error.retry_after))
    if isinstance(error, EngineDeadError):
        return ApiError(503, f"the engine cannot serve this request: {error}", code=type(error).__name__)
    return ApiError(500, f"the engine failed: {type(error).__name__}: {error}")


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def from_http_exception(error: web.HTTPException) -> ApiError:
    """aiohttp's own errors (unknown route, wrong method, body too large) in the same JSON shape."""
    message = error.text or error.reason
    if error.status == 404:
        message = "no such endpoint; see /v1/models, /v1/completions, /v1/chat/completions"
    headers = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else {}
    return ApiError(error.status, message, headers=headers)


def internal_error(request_id: str) -> ApiError:
    return ApiError(500, f"internal server error (request {request_id}); the server log has the details")


@contextmanager
def engine_errors(param_names: dict[str, str]) -> Iterator[None]:
    """Typed engine errors raised inside the block become the matching ApiError."""
    try:
        yield
    except HypicError as error:
        raise from_engine_error(error, param_names) from None
