"""Reading a request body into its Struct, and the checks every generation endpoint shares."""
from __future__ import annotations

from typing import TypeVar

import msgspec
from aiohttp import web

from hypic.serve.http_errors import ApiError, bad_request, from_body_error
from hypic.serve.state import ServerState

Body = TypeVar("Body", bound=msgspec.Struct)


async def read_body(request: web.Request, body_type: type[Body]) -> Body:
    raw = await request.read()  # aiohttp enforces the size limit (413)
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.MsgspecError as error:
        raise from_body_error(error) from None


def check_model(state: ServerState, requested: str | None) -> None:
    if requested is not None and requested != state.model_name:
        raise ApiError(
            404, f"model {requested!r} is not served here; this server serves {state.model_name!r}",
            "model", "model_not_found",
        )


def check_stream_options(stream: bool, stream_options: object | None) -> None:
    if stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


def reject_unsupported(fields: list[str]) -> None:
    if fields:
        raise bad_request(f"{fields[0]} is not supported by hypic yet; remove it from the request", fields[0])
