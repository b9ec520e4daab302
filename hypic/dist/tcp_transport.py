"""The TCP data plane: each payload follows its header on the same socket as raw bytes.

Works between any two processes (CPU-only machines, CI, two engines sharing one GPU). Received
tensors land in CPU memory. CUDA tensors are copied to pinned host memory on a side stream that
waits for the segment's CUDA event, so the copy overlaps the next segment's prefill.
"""
from __future__ import annotations

import asyncio

import torch

from hypic.dist.transport import TensorTransport, _Peer

_CHUNK = 1 << 20  # bytes per socket write/read: bounded buffering, steady backpressure


class TcpTransport(TensorTransport):
    name = "tcp"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}

    async def _send_payload(self, peer: _Peer, tensors: list[torch.Tensor], ready: object | None) -> None:
        for tensor in await self._to_host(tensors, ready):
            view = _byte_view(tensor)
            for offset in range(0, len(view), _CHUNK):
                peer.writer.write(view[offset: offset + _CHUNK])
                await peer.writer.drain()

    async def _receive_payload(self, reader: asyncio.StreamReader, state: object,
                               tensors: list[torch.Tensor], ready: object | None) -> None:
        for tensor in tensors:
            view = _byte_view(tensor)
            for offset in range(0, len(view), _CHUNK):
                data = await reader.readexactly(min(_CHUNK, len(view) - offset))
                view[offset: offset + len(data)] = data

    async def _to_host(self, tensors: list[torch.Tensor], ready: object | None) -> list[torch.Tensor]:
        on_gpu = [t for t in tensors if t.is_cuda]
        if not on_gpu:
            return tensors
        stream = self._copy_stream(on_gpu[0].device)
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            host = [_pinned_copy(t) if t.is_cuda else t for t in tensors]
            done = stream.record_event()
        await asyncio.to_thread(done.synchronize)  # the loop keeps serving while the copy runs
        return host

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (any dtype, bf16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
