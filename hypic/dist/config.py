"""Settings of a segment-parallel cluster (router, engine nodes, faults). Defaults suit one host."""
from __future__ import annotations

from dataclasses import dataclass

from hypic.errors import InvalidRequestError

TRANSPORTS = ("auto", "tcp", "nccl")
ASSIGNMENTS = ("lpt", "round_robin")


@dataclass(frozen=True)
class DistConfig:
    router_address: str = "tcp://127.0.0.1:0"
    """Where the router listens for engine nodes (port 0: any free port)."""
    data_host: str = "127.0.0.1"
    """Host engine nodes bind their data plane to (another machine's nodes must reach it)."""
    transport: str = "auto"
    """tcp | nccl | auto (nccl when every node has a GPU of its own, else tcp)."""
    heartbeat_s: float = 0.5
    """How often a node reports its stats (also its liveness)."""
    node_timeout_s: float = 10.0
    """A node that neither heartbeats nor uses CPU (its pulse tells) this long is treated as hung: its
    segment work is re-dispatched, its requests go on elsewhere. A busy node is never hung."""
    segment_timeout_s: float = 120.0
    """A dispatched segment not in the combine node's store by then is re-dispatched."""
    rpc_timeout_s: float = 30.0
    """Planning and probe calls."""
    start_timeout_s: float = 900.0
    """Longest wait for every node to load its model and join."""
    assignment: str = "lpt"
    """How cold segments are spread: lpt (Longest-Processing-Time first, from current loads) or
    round_robin (in prompt order; a baseline for benchmarks)."""
    min_remote_tokens: int = 256
    """Cold segments shorter than this are prefilled on the combine node (shipping costs more)."""
    combine_load_slack_tokens: int = 8192
    """A node that holds more of a request's segments (or served its conversation) stays the combine
    node unless it is busier than the least loaded node by more than this many prefill tokens."""
    decode_token_weight: int = 64
    """Load of one running request, in prefill tokens (load = pending prefill tokens + this x running)."""
    affinity_granularity: int = 64
    """Tokens per block of the prefix hash that maps a conversation to the node that served it."""
    affinity_entries: int = 65536
    directory_entries: int = 1 << 20
    """Most segment keys the router remembers the holders of."""
    restart_nodes: bool = True
    """Respawn a node process that dies (it rejoins under its id)."""
    max_restarts: int = 5
    """Consecutive failed starts of one node before it is left down."""
    max_attempts: int = 3
    """Combine nodes tried for one request when they die under it."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise InvalidRequestError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for name in ("heartbeat_s", "node_timeout_s", "segment_timeout_s", "rpc_timeout_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if self.node_timeout_s <= 2 * self.heartbeat_s:
            raise InvalidRequestError("node_timeout_s must exceed two heartbeats, or healthy nodes look hung")
        if self.assignment not in ASSIGNMENTS:
            raise InvalidRequestError(f"assignment must be one of {ASSIGNMENTS}, got {self.assignment!r}")
        if self.affinity_granularity <= 0 or self.max_attempts <= 0:
            raise InvalidRequestError("affinity_granularity and max_attempts must be positive")
