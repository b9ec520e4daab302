"""Addresses of the control and data planes: "tcp://HOST:PORT" or "unix:///PATH".

Processes find each other by address only, so the same layout spans machines (tcp) or stays on one
(unix sockets skip the TCP stack).
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

StreamHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
_SOCKET_BUFFER = 4 << 20  # large transfers: fewer wakeups per MB


@dataclass(frozen=True)
class Address:
    scheme: str  # "tcp" | "unix"
    host: str  # tcp only
    port: int  # tcp only (0: any free port)
    path: str  # unix only

    @classmethod
    def parse(cls, text: str) -> Address:
        scheme, sep, rest = text.partition("://")
        if sep and scheme == "unix" and rest:
            return cls("unix", "", 0, rest)
        host, colon, port = rest.rpartition(":")
        if not (sep and scheme == "tcp" and colon and host and port.isdigit()):
            raise ValueError(f"expected tcp://HOST:PORT or unix:///PATH, got {text!r}")
        return cls("tcp", host.strip("[]"), int(port), "")

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    where = Address.parse(address)
    if where.scheme == "unix":
        return await asyncio.open_unix_connection(where.path)
    reader, writer = await asyncio.open_connection(where.host, where.port)
    _tune(writer)
    return reader, writer


async def listen(address: str, handler: StreamHandler) -> tuple[asyncio.AbstractServer, str]:
    """A server on `address`; returns it and the address it is bound to (the real port for port 0)."""
    where = Address.parse(address)
    if where.scheme == "unix":
        return await asyncio.start_unix_server(_tuned(handler), where.path), str(where)
    server = await asyncio.start_server(_tuned(handler), where.host, where.port)
    port = server.sockets[0].getsockname()[1]
    return server, str(Address("tcp", where.host, port, ""))


def _tuned(handler: StreamHandler) -> StreamHandler:
    async def tuned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _tune(writer)
        await handler(reader, writer)
    return tuned


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small control frames go out at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
