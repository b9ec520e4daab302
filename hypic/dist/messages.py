"""Control-plane messages (msgspec Structs) and their length-prefixed framing over asyncio streams.

Two conversations, each a tagged union:
- router <-> engine node (`NodeMessage`): joining, requests and their outputs, segment dispatch,
  progress, cancel, heartbeats, probes, shutdown; and a node's pulse process -> router (its own
  connection: `PulseHello`, then `Pulse`s);
- engine node -> engine node on a data connection (`DataMessage`): the header of each tensor
  transfer, and the NCCL unique id when the payload goes through NCCL.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from hypic.outputs import RequestOutput
from hypic.sampling_params import SamplingParams

MAX_FRAME_BYTES = 256 << 20  # a full-context prompt of token ids is a few MB; anything bigger is garbage
_LENGTH = 4


class ProtocolError(ConnectionError):
    """The peer sent something that is not a frame of this protocol."""


# -- shared pieces ---------------------------------------------------------------------------------

class KeyRef(msgspec.Struct, frozen=True, array_like=True):
    """A SegmentKey on the wire."""

    digest: bytes
    salt: str | None


class PlannedJob(msgspec.Struct, frozen=True, array_like=True):
    """A PIC segment of a prompt (hypic.engine.pic.plan.SegmentJob on the wire)."""

    key: KeyRef
    token_ids: tuple[int, ...]
    interior: tuple[int, int]
    identity_T: bool
    tier: str | None = None  # the planning node's best tier holding it now (None: not held)


class Job(msgspec.Struct, frozen=True, array_like=True):
    """A segment to prefill, to ship or to receive, and the transfer that carries it (token_ids are
    only sent to the node that prefills it)."""

    segment: PlannedJob
    transfer_id: int


class ErrorInfo(msgspec.Struct, frozen=True):
    kind: str  # class name in hypic.errors, or the builtin's name
    message: str
    fields: dict[str, int | float | str] = {}


class NodeCounters(msgspec.Struct, frozen=True):
    """What one engine node did for segment parallelism (counters) and holds now (gauges)."""

    segments_built: int = 0
    segments_exported: int = 0  # pulls served
    segment_failures: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    transfers_dropped: int = 0  # arrived for a cancelled or unknown transfer
    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0
    pending_receives: int = 0  # gauge: expected or parked transfers, with their buffers
    pending_receive_bytes: int = 0  # gauge
    active_segment_jobs: int = 0  # gauge: builds and pulls in progress


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]


# -- router <-> engine node ------------------------------------------------------------------------

class Hello(msgspec.Struct, frozen=True, tag=True):
    """First message of a node on its router connection (a restarted node sends it again)."""

    node_id: int  # -1: let the router pick one
    pid: int
    device: str  # "cpu", "cuda:3" (the physical GPU)
    data_address: str  # where peers send tensors
    transport: str  # "tcp" | "nccl"
    model_name: str
    max_model_len: int


class Welcome(msgspec.Struct, frozen=True, tag=True):
    node_id: int


class PulseHello(msgspec.Struct, frozen=True, tag=True):
    """First message of a node's pulse process, on a connection of its own (`hypic.dist.pulse`)."""

    node_id: int
    pid: int  # the node process it watches


class Pulse(msgspec.Struct, frozen=True, tag=True):
    cpu_seconds: float  # CPU time the node process has used: grows while it is busy, not while hung


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    stats: dict[str, Any]  # the engine's EngineStats as builtins
    counters: NodeCounters


class TierMove(msgspec.Struct, frozen=True, array_like=True):
    key: KeyRef
    tier: str | None  # the node's best tier holding the key now: pool | host | disk; None: dropped


class TierMoves(msgspec.Struct, frozen=True, tag=True):
    """A node's keys whose best tier changed since its last report (sent at heartbeat pace)."""

    moves: list[TierMove]


class Generate(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt: str | list[str | int | list[int]]
    params: SamplingParams
    cache_salt: str | None = None
    cache_mode: str | None = None
    add_special_tokens: bool = True
    resume: dict[int, list[int]] = {}  # completion -> ids it generated on a node that died


class Output(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    output: RequestOutput


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The request could not run on this node (raised where the engine would raise it)."""

    request_id: str
    error: ErrorInfo


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Plan(msgspec.Struct, frozen=True, tag=True):
    """Split and hash a prompt: which PIC segments it has, and its prefix hashes (affinity)."""

    call_id: int
    prompt: str | list[str | int | list[int]]
    cache_salt: str | None = None
    cache_mode: str | None = None
    add_special_tokens: bool = True
    max_tokens: int = 0  # a prompt that leaves no room for them is refused here, before any dispatch


class PlanReply(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    prompt_tokens: int = 0
    jobs: list[PlannedJob] = []
    prefix_hashes: list[int] = []
    error: ErrorInfo | None = None


class Build(msgspec.Struct, frozen=True, tag=True):
    """Prefill these segments together (one engine step) and send each to `dest_address` (dest_node
    == this node: keep it, nothing to send)."""

    request_id: str
    dest_node: int
    dest_address: str
    jobs: list[Job]


class Pull(msgspec.Struct, frozen=True, tag=True):
    """Send these stored segments to `dest_address` (waiting for a build of them in progress here)."""

    request_id: str
    dest_node: int
    dest_address: str
    jobs: list[Job]


class Expect(msgspec.Struct, frozen=True, tag=True):
    """To the combine node: allocate the destination of these transfers now, import each on arrival."""

    request_id: str
    jobs: list[Job]


class Progress(msgspec.Struct, frozen=True, tag=True):
    """A segment job's milestone on its source node: built | sent | failed | missing."""

    request_id: str
    transfer_id: int
    event: str
    seconds: float = 0.0
    nbytes: int = 0
    error: ErrorInfo | None = None


class Arrived(msgspec.Struct, frozen=True, tag=True):
    """On the combine node: the segment is in its store (stored=False: it did not fit)."""

    request_id: str
    transfer_id: int
    stored: bool
    seconds: float = 0.0  # header received -> imported
    nbytes: int = 0


class Cancel(msgspec.Struct, frozen=True, tag=True):
    """Drop every segment job and expected transfer of the request on this node."""

    request_id: str


class Probe(msgspec.Struct, frozen=True, tag=True):
    call_id: int


class ProbeReply(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    stats: dict[str, Any]
    counters: NodeCounters


class Flush(msgspec.Struct, frozen=True, tag=True):
    """Drop the node's cached segments and prefix checkpoints (of one salt, or all)."""

    call_id: int
    salt: str | None


class FlushReply(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    flushed: int


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    grace_s: float = 0.0


NodeMessage = (Hello | Welcome | PulseHello | Pulse | Heartbeat | TierMoves | Generate | Output | Failed | Abort | Plan | PlanReply | Build
               | Pull | Expect | Progress | Arrived | Cancel | Probe | ProbeReply | Flush | FlushReply | Shutdown)


# -- engine node -> engine node (data connections) -------------------------------------------------

class TransferHeader(msgspec.Struct, frozen=True, tag=True):
    """Precedes a transfer's payload: the tensors' specs, in order, and what they are (meta)."""

    transfer_id: int
    request_id: str
    tensors: list[TensorSpec]
    meta: bytes = b""


class NcclHello(msgspec.Struct, frozen=True, tag=True):
    """First message of an NCCL data connection: the sender is rank 0, the receiver rank 1."""

    unique_id: bytes


DataMessage = TransferHeader | NcclHello


# -- framing ---------------------------------------------------------------------------------------

class Codec:
    """Encodes any of the messages; decodes one union."""

    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, payload: bytes) -> Any:
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as error:
            raise ProtocolError(f"undecodable message: {error}") from error


NODE_CODEC = Codec(NodeMessage)
DATA_CODEC = Codec(DataMessage)


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {len(payload)}-byte message exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return len(payload).to_bytes(_LENGTH, "big") + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's payload; IncompleteReadError at a clean or torn end of stream."""
    length = int.from_bytes(await reader.readexactly(_LENGTH), "big")
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return await reader.readexactly(length)


async def write_message(writer: asyncio.StreamWriter, message: msgspec.Struct, codec: Codec) -> None:
    writer.write(frame(codec.encode(message)))
    await writer.drain()


async def read_message(reader: asyncio.StreamReader, codec: Codec) -> Any:
    return codec.decode(await read_frame(reader))
