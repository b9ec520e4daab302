"""The tensor data plane between engine nodes: send a list of tensors to a peer, receive them into
destination tensors the receiver allocated beforehand.

Each transfer is a `TransferHeader` (the tensors' dtypes and shapes) on a TCP/unix connection from
sender to receiver, followed by its payload; the payload's path is the subclass's: the same socket
(`TcpTransport`) or NCCL point-to-point (`NcclTransport`). One connection per (sender, receiver)
direction carries that direction's transfers in order, so headers and payloads pair up without ids.

Receiving: `expect(transfer_id, request_id, dests)` registers the destination before the transfer is
dispatched; a transfer that arrives first is received into fresh tensors and parked until expected;
one for a cancelled request is received and dropped. Nothing is held past `cancel(request_id)`.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from hypic.dist.messages import DATA_CODEC, TensorSpec, TransferHeader, read_message, write_message
from hypic.dist.net import connect, listen

log = logging.getLogger("hypic.dist")
_PARK_TTL_S = 120.0  # a parked transfer nobody expects (its router forgot it) is dropped after this
_CANCELLED_MEMORY = 4096  # request ids whose late transfers are dropped on arrival


@dataclass(frozen=True)
class Received:
    tensors: list[torch.Tensor]
    meta: bytes
    nbytes: int
    seconds: float  # header read -> payload complete
    preallocated: bool  # landed in the destination given to `expect`


@dataclass
class TransportCounters:
    sent: int = 0
    received: int = 0
    dropped: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0


@dataclass
class _Slot:
    request_id: str
    dests: list[torch.Tensor] | None
    future: asyncio.Future | None = None  # set when expected
    ready: object | None = None  # the destination's `_destination_ready` marker
    parked: Received | None = None  # set when it arrived before anyone expected it
    parked_at: float = 0.0


@dataclass
class _Peer:
    """One outgoing connection; transfers on it are serialized by `lock`."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: object = None  # the payload channel's (an NCCL communicator and its stream)
    watcher: asyncio.Task | None = None  # ends the connection when the receiver hangs up


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def dtype_of(spec: TensorSpec) -> torch.dtype:
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {spec.dtype!r} in a transfer header")
    return dtype


def allocate(specs: list[TensorSpec], device: torch.device, *, pin: bool = False) -> list[torch.Tensor]:
    return [torch.empty(s.shape, dtype=dtype_of(s), device=device, pin_memory=pin) for s in specs]


def nbytes_of(specs: list[TensorSpec]) -> int:
    return sum(math.prod(s.shape) * dtype_of(s).itemsize for s in specs)


class TensorTransport(ABC):
    """Sends and receives lists of tensors between engine nodes (see the module docstring)."""

    name: str

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where received tensors land
        self.address = ""
        self.counters = TransportCounters()
        self._server: asyncio.AbstractServer | None = None
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._slots: dict[int, _Slot] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._accepted: set[asyncio.StreamWriter] = set()  # incoming connections, closed on close()

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self, listen_address: str) -> str:
        """Listen for incoming transfers; returns the bound address peers send to."""
        self._server, self.address = await listen(listen_address, self._accept)
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for address, peer in list(self._peers.items()):
            self._drop_peer(address, peer)
        for writer in list(self._accepted):
            writer.close()  # their readers see EOF and end
        for slot in self._slots.values():
            if slot.future is not None and not slot.future.done():
                slot.future.cancel()
        self._slots.clear()

    # -- receiving --------------------------------------------------------------------------------

    def expect(self, transfer_id: int, request_id: str, dests: list[torch.Tensor] | None) -> asyncio.Future:
        """A future of the `Received` transfer; `dests` (contiguous, on `self.device`) is filled
        in place when the sender's shapes and dtypes match it, else fresh tensors are returned."""
        for dest in dests or ():
            self._check_destination(dest)
        future = asyncio.get_running_loop().create_future()
        slot = self._slots.get(transfer_id)
        if slot is not None and slot.parked is not None:
            del self._slots[transfer_id]
            future.set_result(slot.parked)
        else:
            ready = self._destination_ready(dests) if dests else None
            self._slots[transfer_id] = _Slot(request_id, dests, future, ready)
        return future

    def cancel(self, request_id: str) -> None:
        """Forget every expected or parked transfer of the request; later ones are dropped."""
        self._cancelled[request_id] = None
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        for transfer_id in [t for t, s in self._slots.items() if s.request_id == request_id]:
            slot = self._slots.pop(transfer_id)
            if slot.future is not None and not slot.future.done():
                slot.future.cancel()

    def pending(self) -> tuple[int, int]:
        """(transfers, bytes) held for receiving: expected destinations and parked arrivals."""
        held = [s.parked.tensors if s.parked is not None else s.dests or [] for s in self._slots.values()]
        return len(held), sum(t.numel() * t.element_size() for ts in held for t in ts)

    # -- sending ----------------------------------------------------------------------------------

    async def send(self, address: str, transfer_id: int, request_id: str, tensors: list[torch.Tensor], *,
                   meta: bytes = b"", ready: object | None = None) -> float:
        """Send `tensors` (made contiguous) to the node listening at `address`; `ready` is a CUDA
        event after which they are complete (the payload waits for it on a side stream, not the
        host). Returns the seconds it took; raises ConnectionError if the peer is gone."""
        tensors = [t.contiguous() for t in tensors]
        header = TransferHeader(transfer_id, request_id, [spec_of(t) for t in tensors], meta)
        peer = await self._peer(address)
        start = time.perf_counter()
        # Shielded: a caller cancelled mid-payload must not leave half a transfer on the connection.
        transfer = asyncio.ensure_future(self._transfer(peer, header, tensors, ready))
        transfer.add_done_callback(_retrieve)  # its failure is the caller's to see, if it still waits
        try:
            await asyncio.shield(transfer)
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            self._drop_peer(address, peer)
            raise ConnectionError(f"sending to {address} failed: {error!r}") from error
        seconds = time.perf_counter() - start
        self._count_sent(tensors, seconds)
        return seconds

    async def _transfer(self, peer: _Peer, header: TransferHeader, tensors: list[torch.Tensor],
                        ready: object | None) -> None:
        async with peer.lock:
            await write_message(peer.writer, header, DATA_CODEC)
            await self._send_payload(peer, tensors, ready)

    async def _peer(self, address: str) -> _Peer:
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            if address not in self._peers:
                try:
                    reader, writer = await connect(address)
                except OSError as error:
                    raise ConnectionError(f"cannot reach node at {address}: {error}") from error
                peer = _Peer(reader, writer)
                peer.state = await self._open_channel(peer)
                peer.watcher = asyncio.create_task(self._watch(address, peer))
                self._peers[address] = peer
            return self._peers[address]

    async def _watch(self, address: str, peer: _Peer) -> None:
        """A receiver never writes back: EOF means it is gone. Dropping the connection then also
        ends a payload waiting for it (NCCL would wait for the receive forever)."""
        await peer.reader.read()
        self._drop_peer(address, peer)

    def _drop_peer(self, address: str, peer: _Peer) -> None:
        if self._peers.get(address) is peer:  # not a newer connection opened since
            del self._peers[address]
        if peer.watcher is not None and peer.watcher is not asyncio.current_task():
            peer.watcher.cancel()
        peer.writer.close()
        self._close_channel(peer.state)

    def _count_sent(self, tensors: list[torch.Tensor], seconds: float) -> None:
        self.counters.sent += 1
        self.counters.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        self.counters.send_seconds += seconds

    # -- the receiving side of a connection --------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state = None
        self._accepted.add(writer)
        try:
            state = await self._accept_channel(reader, writer)
            while True:
                header = await read_message(reader, DATA_CODEC)
                await self._receive(reader, state, header)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the sender went away; its transfers in flight are its router's to retry
        finally:
            self._accepted.discard(writer)
            writer.close()
            self._close_channel(state)

    async def _receive(self, reader: asyncio.StreamReader, state: object, header: TransferHeader) -> None:
        slot = self._slots.get(header.transfer_id)
        dests = slot.dests if slot is not None and slot.future is not None else None
        preallocated = dests is not None and [spec_of(d) for d in dests] == header.tensors
        if preallocated:
            tensors, ready = dests, slot.ready
        else:
            tensors = allocate(header.tensors, self.device)
            ready = self._destination_ready(tensors)
        start = time.perf_counter()
        await self._receive_payload(reader, state, tensors, ready)
        nbytes = nbytes_of(header.tensors)
        received = Received(tensors, header.meta, nbytes, time.perf_counter() - start, preallocated)
        self._count_received(received)
        self._deliver(header, received)

    def _deliver(self, header: TransferHeader, received: Received) -> None:
        slot = self._slots.get(header.transfer_id)
        if slot is not None and slot.future is not None:
            del self._slots[header.transfer_id]
            if not slot.future.done():
                slot.future.set_result(received)
            return
        if header.request_id in self._cancelled:
            self.counters.dropped += 1
            return
        self._sweep_parked()
        self._slots[header.transfer_id] = _Slot(header.request_id, None, parked=received, parked_at=time.monotonic())

    def _sweep_parked(self) -> None:
        now = time.monotonic()
        stale = [t for t, s in self._slots.items() if s.parked is not None and now - s.parked_at > _PARK_TTL_S]
        for transfer_id in stale:
            del self._slots[transfer_id]
            self.counters.dropped += 1

    def _count_received(self, received: Received) -> None:
        self.counters.received += 1
        self.counters.bytes_received += received.nbytes
        self.counters.receive_seconds += received.seconds

    def _check_destination(self, dest: torch.Tensor) -> None:
        if not dest.is_contiguous():
            raise ValueError("a transfer destination must be contiguous")
        if dest.device != self.device:
            raise ValueError(f"the {self.name} transport receives on {self.device}, not {dest.device}")

    # -- the payload channel (subclasses) ----------------------------------------------------------

    async def _open_channel(self, peer: _Peer) -> object:
        """Sender side, once per new connection (NCCL: create the communicator)."""
        return None

    async def _accept_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> object:
        """Receiver side, once per accepted connection."""
        return None

    def _close_channel(self, state: object) -> None:
        """Release what `_open_channel` / `_accept_channel` made."""

    def _destination_ready(self, tensors: list[torch.Tensor]) -> object | None:
        """Called right after a destination is allocated: what the payload must wait for before
        writing into it (NCCL: an event on the allocating stream)."""
        return None

    @abstractmethod
    async def _send_payload(self, peer: _Peer, tensors: list[torch.Tensor], ready: object | None) -> None: ...

    @abstractmethod
    async def _receive_payload(self, reader: asyncio.StreamReader, state: object,
                               tensors: list[torch.Tensor], ready: object | None) -> None: ...


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
