"""A node's pulse process reports the node's CPU time on a connection of its own (Linux), however
long the node's own threads are kept busy."""
from __future__ import annotations

import os
import socket
import time

import pytest

from hypic.dist import pulse
from hypic.dist.messages import NODE_CODEC, Pulse, PulseHello

pytestmark = pytest.mark.skipif(not pulse.available(), reason="the pulse reads /proc")


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


def test_cpu_seconds_is_what_the_process_itself_counts():
    spin(0.2)
    times = os.times()
    assert pulse.cpu_seconds(os.getpid()) == pytest.approx(times.user + times.system, abs=0.05)


def test_the_pulse_reports_the_cpu_time_of_a_process_too_busy_to_speak():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(10)
        process = pulse.start(f"tcp://127.0.0.1:{server.getsockname()[1]}", 7, 0.05)
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
