"""The router's registry of engine nodes: who joined, who is alive, how loaded each one is.

Nodes connect to the router's address and say `Hello`; the router answers `Welcome` with the node's
id (its own if it asked for one — a restarted node rejoins under its old id). A node whose
connection drops is dead. One whose heartbeats stop is busy while its pulse (`pulse.py`, a process
of its own) shows its CPU time growing, and hung once neither has moved for `node_timeout_s`; it is
usable again when its heartbeats resume. Everything else a node says goes to the listener (the
client).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from hypic.dist.config import DistConfig
from hypic.dist.link import Link
from hypic.dist.messages import (NODE_CODEC, FlushReply, Heartbeat, Hello, NodeCounters, PlanReply, ProbeReply, Pulse,
                                 PulseHello, Welcome, read_message, write_message)
from hypic.dist.net import listen
from hypic.dist.router import NodeLoad

log = logging.getLogger("hypic.dist")


class ClusterListener(Protocol):
    def node_message(self, node: NodeHandle, message: Any) -> None: ...

    def node_up(self, node: NodeHandle) -> None:
        """The node joined (or rejoined after a restart)."""

    def node_down(self, node: NodeHandle, reason: str) -> None:
        """reason: "died" (connection lost) or "hung" (heartbeats stopped)."""


@dataclass(eq=False)
class NodeHandle:
    node_id: int
    hello: Hello
    link: Link
    last_heartbeat: float = field(default_factory=time.monotonic)
    last_progress: float = 0.0  # when its pulse last showed its CPU time growing
    cpu_seconds: float = 0.0  # as its pulse last reported
    stats: dict[str, Any] | None = None  # last heartbeat's EngineStats (builtins)
    counters: NodeCounters = field(default_factory=NodeCounters)
    hung: bool = False
    pending_tokens: int = 0  # router-side: prefill tokens sent its way and not done yet
    running: int = 0  # router-side: requests streaming from it

    @property
    def alive(self) -> bool:
        return not self.link.closed.is_set()

    @property
    def usable(self) -> bool:
        return self.alive and not self.hung and self.stats is not None

    @property
    def name(self) -> str:
        return f"node{self.node_id}({self.hello.device}, pid {self.hello.pid})"

    def load(self) -> NodeLoad:
        return NodeLoad(self.node_id, self.pending_tokens, self.running)

    def last_sign_of_life(self) -> float:
        return max(self.last_heartbeat, self.last_progress)

    def pulse(self, cpu_seconds: float) -> None:
        if cpu_seconds > self.cpu_seconds:
            self.cpu_seconds, self.last_progress = cpu_seconds, time.monotonic()

    async def send(self, message: Any) -> bool:
        """False when the node's connection is gone (its death is handled where it is noticed)."""
        try:
            await self.link.send(message)
            return True
        except ConnectionError:
            return False


class Cluster:
    def __init__(self, config: DistConfig, listener: ClusterListener) -> None:
        self.config = config
        self.nodes: dict[int, NodeHandle] = {}
        self.deaths = self.hangs = 0
        self._listener = listener
        self._seen: set[int] = set()
        self._changed = asyncio.Condition()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self.closing = False  # set when the cluster shuts down: nodes leaving is expected

    async def start(self) -> str:
        """Listen for nodes; returns the address they join at."""
        self._server, address = await listen(self.config.router_address, self._accept)
        self._spawn(self._watch_heartbeats())
        return address

    async def close(self) -> None:
        self.closing = True
        if self._server is not None:
            self._server.close()
        for node in list(self.nodes.values()):
            node.link.close()
        for task in list(self._tasks):
            task.cancel()

    def usable(self) -> list[NodeHandle]:
        return [n for n in self.nodes.values() if n.usable]

    def alive(self) -> list[NodeHandle]:
        return [n for n in self.nodes.values() if n.alive]

    def responsive(self, nodes: list[NodeHandle]) -> list[NodeHandle]:
        """Those of `nodes` heartbeating now (not busy with something long), or all if none is."""
        now = time.monotonic()
        fresh = [n for n in nodes if now - n.last_heartbeat <= 2 * self.config.heartbeat_s]
        return fresh or nodes

    async def wait_until(self, predicate: Any, timeout: float) -> None:
        """Until predicate(self) holds (re-checked whenever a node joins, heartbeats, or leaves)."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout)

    # -- joining and leaving ----------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_message(reader, NODE_CODEC)
        if isinstance(hello, PulseHello):
            await self._read_pulses(hello, reader, writer)
            return
        if not isinstance(hello, Hello):
            log.error("a connection opened with %s, not Hello; closing it", type(hello).__name__)
            writer.close()
            return
        node_id = self._id_for(hello)
        await write_message(writer, Welcome(node_id), NODE_CODEC)
        handle = NodeHandle(node_id, hello, Link(reader, writer, NODE_CODEC, lambda m: self._on_message(handle, m),
                                                 f"node{node_id}", (PlanReply, ProbeReply, FlushReply)))
        previous = self.nodes.get(node_id)
        if previous is not None:
            previous.link.close()  # a stale connection of the same node (it restarted)
        self.nodes[node_id] = handle
        self._seen.add(node_id)
        handle.link.start()
        self._spawn(self._watch_link(handle))
        log.info("%s joined (data %s over %s)", handle.name, hello.data_address, hello.transport)
        self._listener.node_up(handle)
        await self.notify()

    async def _read_pulses(self, hello: PulseHello, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        handle = self.nodes.get(hello.node_id)
        try:
            while handle is not None and handle.hello.pid == hello.pid and handle.alive:
                message = await read_message(reader, NODE_CODEC)
                if isinstance(message, Pulse):
                    handle.pulse(message.cpu_seconds)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the pulse exited with its node
        finally:
            writer.close()

    def _id_for(self, hello: Hello) -> int:
        if hello.node_id >= 0:
            return hello.node_id
        return max(self._seen | set(self.nodes), default=-1) + 1

    async def _watch_link(self, handle: NodeHandle) -> None:
        await handle.link.closed.wait()
        if self.nodes.get(handle.node_id) is handle:
            del self.nodes[handle.node_id]
        if not self.closing:
            self.deaths += 1
            log.warning("%s left (connection closed)", handle.name)
        self._listener.node_down(handle, "died")  # what it was doing fails over, or ends at shutdown
        await self.notify()

    # -- heartbeats -------------------------------------------------------------------------------

    def _on_message(self, handle: NodeHandle, message: Any) -> None:
        if not isinstance(message, Heartbeat):
            self._listener.node_message(handle, message)
            return
        if handle.hung:
            log.warning("%s is answering again", handle.name)
        handle.stats, handle.counters, handle.last_heartbeat = message.stats, message.counters, time.monotonic()
        handle.hung = False
        self._spawn(self.notify())

    async def _watch_heartbeats(self) -> None:
        tick = time.monotonic()
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            now, last = time.monotonic(), tick
            tick = now
            if now - last > 2 * self.config.heartbeat_s:
                continue  # this event loop was held up: what the nodes sent meanwhile is not read yet
            for handle in list(self.nodes.values()):
                silent = now - handle.last_sign_of_life()
                if not handle.hung and handle.stats is not None and silent > self.config.node_timeout_s:
                    self._hung(handle, silent)

    def _hung(self, handle: NodeHandle, silent: float) -> None:
        handle.hung = True
        self.hangs += 1
        log.warning("%s sent no heartbeat and used no CPU for %.1f s: treating it as hung", handle.name, silent)
        self._listener.node_down(handle, "hung")

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
