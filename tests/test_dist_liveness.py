"""Busy is not hung: a node's pulse process reports its CPU time on a connection of its own (Linux),
however long the node's own threads are kept busy; the router declares a node hung only when
neither its heartbeats nor that CPU time moved for the timeout, and never for its own stalls."""
from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time

import pytest

from hypic.dist import pulse
from hypic.dist.cluster import Cluster
from hypic.dist.config import DistConfig
from hypic.dist.messages import (NODE_CODEC, Heartbeat, Hello, NodeCounters, Pulse, PulseHello, Welcome, read_message,
                                 write_message)
from hypic.dist.net import connect

LIVENESS = DistConfig(heartbeat_s=0.05, node_timeout_s=0.3)

needs_proc = pytest.mark.skipif(not pulse.available(), reason="the pulse reads /proc")


def spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def read(conn: socket.socket):
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "the pulse closed its connection"
            data += chunk
        return data
    return NODE_CODEC.decode(exactly(int.from_bytes(exactly(4), "big")))


@needs_proc
def test_cpu_seconds_is_what_the_process_itself_counts():
    spin(0.2)
    times = os.times()
    assert pulse.cpu_seconds(os.getpid()) == pytest.approx(times.user + times.system, abs=0.05)


@needs_proc
def test_the_pulse_reports_the_cpu_time_of_a_process_too_busy_to_speak():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(10)
        process = pulse.start_pulse(f"tcp://127.0.0.1:{server.getsockname()[1]}", 7, 0.05)
        try:
            conn, _ = server.accept()
            conn.settimeout(10)
            assert read(conn) == PulseHello(7, os.getpid())
            first = read(conn)
            spin(0.3)  # holding the GIL all along, as a long tokenization does
            reports = [read(conn)]
            while reports[-1].cpu_seconds - first.cpu_seconds < 0.25 and len(reports) < 100:
                reports.append(read(conn))  # what it sent while this process was busy
        finally:
            process.terminate()
            process.wait()
    assert isinstance(first, Pulse) and all(isinstance(r, Pulse) for r in reports)
    assert reports[-1].cpu_seconds - first.cpu_seconds >= 0.25


class Listener:
    def __init__(self) -> None:
        self.down: list[tuple[int, str]] = []

    def node_message(self, node, message) -> None:
        pass

    def node_up(self, node) -> None:
        pass

    def node_down(self, node, reason: str) -> None:
        self.down.append((node.node_id, reason))


class FakeNode:
    """A node's side of the router protocol: it joins, heartbeats while `speaking`, and pulses
    `cpu_seconds` (growing while `working`) on a second connection."""

    def __init__(self, pid: int) -> None:
        self.pid, self.speaking, self.working = pid, True, False
        self.cpu = itertools.count()

    async def join(self, address: str) -> None:
        reader, self.writer = await connect(address)
        await write_message(self.writer, Hello(-1, self.pid, "cpu", "tcp://127.0.0.1:1", "tcp", "m", 64), NODE_CODEC)
        self.node_id = (await read_message(reader, NODE_CODEC)).node_id
        _, self.pulse_writer = await connect(address)
        await write_message(self.pulse_writer, PulseHello(self.node_id, self.pid), NODE_CODEC)
        self.tasks = [asyncio.create_task(self._beat())]

    async def _beat(self) -> None:
        while True:
            if self.speaking:
                await write_message(self.writer, Heartbeat({}, NodeCounters()), NODE_CODEC)
            cpu = next(self.cpu) if self.working else 0
            await write_message(self.pulse_writer, Pulse(float(cpu)), NODE_CODEC)
            await asyncio.sleep(LIVENESS.heartbeat_s)


async def cluster_of(count: int) -> tuple[Cluster, Listener, list[FakeNode]]:
    listener = Listener()
    cluster = Cluster(LIVENESS, listener)
    address = await cluster.start()
    nodes = [FakeNode(1000 + i) for i in range(count)]
    for node in nodes:
        await node.join(address)
    await cluster.wait_until(lambda c: len(c.usable()) == count, 5)
    return cluster, listener, nodes


def test_a_silent_node_is_hung_unless_its_pulse_shows_it_working():
    async def main() -> tuple[list, list]:
        cluster, listener, (busy, stuck, fine) = await cluster_of(3)
        busy.speaking, busy.working = False, True  # e.g. tokenizing a huge prompt on its event loop
        stuck.speaking = False  # stopped or deadlocked: its CPU time stands still
        await asyncio.sleep(4 * LIVENESS.node_timeout_s)
        usable = sorted(n.node_id for n in cluster.usable())
        responsive = [n.node_id for n in cluster.responsive(cluster.usable())]
        await cluster.close()
        return listener.down, [usable, responsive, [busy.node_id, fine.node_id], [fine.node_id], stuck.node_id]
    down, (usable, responsive, want_usable, want_responsive, stuck) = asyncio.run(main())
    assert down == [(stuck, "hung")]
    assert usable == want_usable and responsive == want_responsive  # new work goes to the node that answers


def test_the_routers_own_stall_hangs_no_node():
    async def main() -> list:
        cluster, listener, _ = await cluster_of(2)
        await asyncio.sleep(2 * LIVENESS.heartbeat_s)
        time.sleep(3 * LIVENESS.node_timeout_s)  # the router's event loop held (e.g. by a long tokenization)
        await asyncio.sleep(4 * LIVENESS.heartbeat_s)
        await cluster.close()
        return listener.down
    assert asyncio.run(main()) == []
