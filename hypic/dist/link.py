"""One framed, bidirectional message connection with request/reply calls on top.

The link reads in its own task and hands every message to `on_message` (synchronously: handlers that
need to wait start their own task). A reply (one of `reply_types`, carrying the `call_id` a `call`
waits for) resolves that call instead. When the connection ends, every pending call fails with
ConnectionError and `closed` is set.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from hypic.dist.messages import Codec, ProtocolError, frame, read_frame

log = logging.getLogger("hypic.dist")


class Link:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: Codec,
                 on_message: Callable[[Any], None], name: str, reply_types: tuple[type, ...] = ()) -> None:
        self.name = name
        self.closed = asyncio.Event()
        self._reader, self._writer, self._codec = reader, writer, codec
        self._on_message, self._reply_types = on_message, reply_types
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._read_loop(), name=f"link-{self.name}")

    async def send(self, message: msgspec.Struct) -> None:
        """Raises ConnectionError when the peer is gone."""
        if self.closed.is_set():
            raise ConnectionError(f"link {self.name} is closed")
        self._writer.write(frame(self._codec.encode(message)))
        await self._writer.drain()

    async def call(self, make: Callable[[int], msgspec.Struct], timeout: float) -> Any:
        """Send `make(call_id)` and return the reply carrying that call_id; ConnectionError when the
        link closes first, TimeoutError after `timeout` seconds."""
        call_id = next(self._call_ids)
        reply = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self.send(make(call_id))
            return await asyncio.wait_for(reply, timeout)
        finally:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._shut()

    async def _read_loop(self) -> None:
        try:
            while True:
                self._dispatch(self._codec.decode(await read_frame(self._reader)))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as error:
            if not isinstance(error, asyncio.IncompleteReadError) or error.partial:
                log.warning("link %s: %r", self.name, error)
        except ProtocolError as error:
            log.error("link %s: %s", self.name, error)
        finally:
            self._shut()

    def _dispatch(self, message: Any) -> None:
        waiter = self._calls.get(message.call_id) if isinstance(message, self._reply_types) else None
        if waiter is not None and not waiter.done():
            waiter.set_result(message)
            return
        self._on_message(message)

    def _shut(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self._writer.close()
        for waiter in self._calls.values():
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"link {self.name} closed"))
