"""The NCCL data plane: headers on a TCP connection, payloads by NCCL point-to-point (CuPy).

One two-rank communicator per (sender, receiver) direction — the sender is rank 0 — created when
the sender first connects: it draws the unique id, sends it as `NcclHello` on that connection, and
both sides join. One direction per communicator means a send never waits behind a send coming the
other way, and a node that dies takes only its own communicators with it.

Sends run on the connection's own CUDA stream, which first waits for the segment's CUDA event: the
transfers overlap whatever the compute stream runs next. Receives run on
the receiver's stream for that connection, after an event recorded when the destination was
allocated (the caching allocator only orders reuse on the allocating stream).

NVLink SHARP multicast stays off (NCCL_NVLS_ENABLE=0): point-to-point never needs it.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from hypic.dist.messages import DATA_CODEC, NcclHello, ProtocolError, read_message, write_message
from hypic.dist.transport import TensorTransport, _Peer

_SENDER, _RECEIVER = 0, 1


@dataclass
class _Channel:
    comm: object  # cupy.cuda.nccl.NcclCommunicator
    stream: torch.cuda.Stream  # this connection's copy stream
    aborted: bool = False


class NcclTransport(TensorTransport):
    name = "nccl"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the NCCL transport needs a CUDA device, got {device}")
        super().__init__(device)
        self._nccl = import_nccl()
        self._uid_is_bytes = isinstance(self._nccl.get_unique_id(), bytes)  # CuPy >= 13 takes bytes

    # -- channels ---------------------------------------------------------------------------------

    async def _open_channel(self, peer: _Peer) -> _Channel:
        unique_id = self._nccl.get_unique_id()
        await write_message(peer.writer, NcclHello(_uid_bytes(unique_id)), DATA_CODEC)
        return _Channel(await asyncio.to_thread(self._join, unique_id, _SENDER), torch.cuda.Stream(self.device))

    async def _accept_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Channel:
        hello = await read_message(reader, DATA_CODEC)
        if not isinstance(hello, NcclHello):
            raise ProtocolError(f"an NCCL data connection must start with NcclHello, got {type(hello).__name__}")
        unique_id = hello.unique_id if self._uid_is_bytes else _uid_tuple(hello.unique_id)
        return _Channel(await asyncio.to_thread(self._join, unique_id, _RECEIVER), torch.cuda.Stream(self.device))

    def _join(self, unique_id: object, rank: int) -> object:
        """Blocks until the other rank joins too (run in a thread)."""
        import cupy

        with cupy.cuda.Device(self.device.index or 0):
            return self._nccl.NcclCommunicator(2, unique_id, rank)

    def _close_channel(self, state: object) -> None:
        """Aborting the communicator also ends a send or receive stuck on a vanished peer."""
        if isinstance(state, _Channel):
            self._abort(state)

    @staticmethod
    def _abort(channel: _Channel) -> None:
        if not channel.aborted:
            channel.aborted = True
            channel.comm.abort()

    def _destination_ready(self, tensors: list[torch.Tensor]) -> object | None:
        return torch.cuda.current_stream(self.device).record_event()

    # -- payloads ---------------------------------------------------------------------------------

    async def _send_payload(self, peer: _Peer, tensors: list[torch.Tensor], ready: object | None) -> None:
        channel: _Channel = peer.state
        with torch.cuda.stream(channel.stream):
            if ready is not None:
                channel.stream.wait_event(ready)
            on_device = [t.to(self.device, non_blocking=True) for t in tensors]
            self._p2p(channel, on_device, send=True)
            done = channel.stream.record_event()
        await self._finish(channel, done)

    async def _receive_payload(self, reader: asyncio.StreamReader, state: object,
                               tensors: list[torch.Tensor], ready: object | None) -> None:
        channel: _Channel = state
        with torch.cuda.stream(channel.stream):
            if ready is not None:
                channel.stream.wait_event(ready)
            self._p2p(channel, tensors, send=False)
            done = channel.stream.record_event()
        await self._finish(channel, done)

    def _p2p(self, channel: _Channel, tensors: list[torch.Tensor], *, send: bool) -> None:
        """One NCCL group of byte-wise sends (or receives): one launch for the whole tuple."""
        nccl, comm = self._nccl, channel.comm
        op, peer = (comm.send, _RECEIVER) if send else (comm.recv, _SENDER)
        nccl.groupStart()
        try:
            for tensor in tensors:
                if tensor.numel():  # both sides skip the same empty tensors: the specs are shared
                    op(tensor.data_ptr(), tensor.numel() * tensor.element_size(), nccl.NCCL_UINT8, peer,
                       channel.stream.cuda_stream)
        finally:
            nccl.groupEnd()

    async def _finish(self, channel: _Channel, done: torch.cuda.Event) -> None:
        """Wait for the stream in a thread (the loop keeps serving); an abort ends the wait."""
        try:
            await asyncio.to_thread(done.synchronize)
        except asyncio.CancelledError:
            self._abort(channel)  # the kernels exit, the thread returns; the buffers stay referenced till then
            raise
        if channel.aborted:
            raise ConnectionError("the NCCL peer went away during a transfer")


def import_nccl() -> ModuleType:
    """cupy.cuda.nccl, imported only when an NCCL transport is built."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    try:
        from cupy.cuda import nccl
    except ImportError as error:
        raise ImportError("the NCCL transport needs CuPy with NCCL: pip install cupy-cuda13x "
                          "(or run the cluster with the tcp transport)") from error
    if not getattr(nccl, "available", True):
        raise ImportError("CuPy was built without NCCL; install a cupy-cuda wheel that bundles it")
    return nccl


def _uid_bytes(unique_id: bytes | tuple[int, ...]) -> bytes:
    return unique_id if isinstance(unique_id, bytes) else bytes(b & 0xFF for b in unique_id)


def _uid_tuple(raw: bytes) -> tuple[int, ...]:
    """Older CuPy wants the id as a tuple of C chars (signed)."""
    return tuple(b - 256 if b > 127 else b for b in raw)
