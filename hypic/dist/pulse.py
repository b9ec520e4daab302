"""A node's pulse: proof of life from a process that nothing in the node can block.

A node heartbeats from its event loop, which a long piece of GIL-holding work (tokenizing a 20 MB
prompt) stops for as long as it runs; a thread would be stopped by the same GIL. So each node also
starts this small process beside it. It opens its own connection to the router and reports, every
heartbeat interval, the CPU time the node process has used. The router tells busy from hung by it:
a node whose heartbeats stopped but whose CPU time still grows is busy, and is never declared hung;
one whose CPU time stands still too (stopped, deadlocked) is. The pulse exits with its node.

Linux only (it reads /proc); elsewhere nodes go without, and heartbeats alone decide.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from hypic.dist.messages import NODE_CODEC, Pulse, PulseHello, frame
from hypic.dist.net import Address

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available() -> bool:
    return Path("/proc/self/stat").exists()


def start_pulse(router_address: str, node_id: int, interval_s: float) -> subprocess.Popen | None:
    """The pulse of this process (None where it cannot read CPU time); terminate it at exit."""
    if not available():
        return None
    command = [sys.executable, "-m", "hypic.dist.pulse", "--router", router_address, "--node-id", str(node_id),
               "--pid", str(os.getpid()), "--interval", str(interval_s)]
    package_root = str(Path(__file__).resolve().parents[2])  # the same hypic as this node's
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, every thread included."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def run(router_address: str, node_id: int, pid: int, interval_s: float) -> None:
    """Report `pid`'s CPU time until it exits or the router goes away."""
    with _connect(router_address) as sock:
        sock.sendall(frame(NODE_CODEC.encode(PulseHello(node_id, pid))))
        while os.getppid() == pid:  # re-parented: the node is gone
            sock.sendall(frame(NODE_CODEC.encode(Pulse(cpu_seconds(pid)))))
            time.sleep(interval_s)


def _connect(address: str) -> socket.socket:
    where = Address.parse(address)
    if where.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(where.path)
        return sock
    return socket.create_connection((where.host, where.port))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hypic.dist.pulse", description=run.__doc__)
    parser.add_argument("--router", required=True)
    parser.add_argument("--node-id", type=int, required=True)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--interval", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        run(args.router, args.node_id, args.pid, args.interval)
    except (OSError, FileNotFoundError):
        pass  # the router or the node went away: nothing left to report to or about
    return 0


if __name__ == "__main__":
    sys.exit(main())
