"""Tensor data plane over TCP: dtypes, layouts, pre-allocated destinations, early/late/cancelled
transfers, dead peers; segment tuples on the wire."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hypic.cache.model_caches import LinearShape
from hypic.cache.prefix_cache import token_bytes
from hypic.cache.segment_store import SegmentKey, SegmentLayout, SegmentStore, SegmentTuple
from hypic.dist.messages import TensorSpec
from hypic.dist.segment_wire import tuple_from, tuple_meta, tuple_specs, tuple_tensors
from hypic.dist.tcp_transport import TcpTransport
from hypic.dist.transport import allocate, spec_of
from hypic.kernels.linear_families import get_family


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g).to(torch.bfloat16),
        torch.randn(700, 1000, generator=g),  # 2.8 MB: several socket chunks
        torch.randint(-2**40, 2**40, (17,), generator=g),
        torch.randint(0, 255, (4, 4), generator=g).to(torch.uint8),
        torch.tensor(3.5, dtype=torch.float64),  # 0-dim
        torch.empty(0, 8, dtype=torch.int32),
        torch.rand(6, generator=g) > 0.5,
        torch.randn(4, 6, generator=g).t(),  # non-contiguous: sent as its contiguous copy
    ]


def run(main) -> None:
    asyncio.run(asyncio.wait_for(main(), 60))


async def pair(tmp_path=None) -> tuple[TcpTransport, TcpTransport]:
    a, b = TcpTransport(), TcpTransport()
    await a.start("tcp://127.0.0.1:0")
    await b.start(f"unix://{tmp_path}/b.sock" if tmp_path else "tcp://127.0.0.1:0")
    return a, b


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_tensors_arrive_bit_exact_into_preallocated_destinations(scheme, tmp_path):
    async def main() -> None:
        a, b = await pair(tmp_path if scheme == "unix" else None)
        sent = tensors()
        dests = allocate([spec_of(t.contiguous()) for t in sent], torch.device("cpu"))
        arrival = b.expect(1, "r", dests)
        assert b.pending() == (1, sum(d.numel() * d.element_size() for d in dests))
        await a.send(b.address, 1, "r", sent, meta=b"m")
        got = await arrival
        assert got.preallocated and got.meta == b"m"
        assert all(x.data_ptr() == d.data_ptr() for x, d in zip(got.tensors, dests))
        for x, y in zip(got.tensors, sent):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        assert b.pending() == (0, 0) and b.counters.received == 1 and a.counters.sent == 1
        await a.close(); await b.close()
    run(main)


def test_mismatched_destinations_are_replaced_and_bad_ones_refused():
    async def main() -> None:
        a, b = await pair()
        arrival = b.expect(2, "r", [torch.empty(2, 2)])
        await a.send(b.address, 2, "r", [torch.ones(3, 3)])
        got = await arrival
        assert not got.preallocated and torch.equal(got.tensors[0], torch.ones(3, 3))
        with pytest.raises(ValueError, match="contiguous"):
            b.expect(3, "r", [torch.empty(4, 4).t()])
        await a.close(); await b.close()
    run(main)


def test_a_transfer_that_arrives_first_is_parked_until_expected():
    async def main() -> None:
        a, b = await pair()
        await a.send(b.address, 7, "r", [torch.arange(10)])
        second = b.expect(8, "r", None)
        await a.send(b.address, 8, "r", [torch.arange(3)])
        await second  # same connection, in order: 7 is parked by now
        assert b.pending() == (1, 80)
        early = b.expect(7, "r", None)
        assert early.done() and torch.equal(early.result().tensors[0], torch.arange(10))
        assert b.pending() == (0, 0)
        await a.send(b.address, 9, "r", [torch.arange(3)])
        b.cancel("r")
        assert b.pending() == (0, 0)
        await a.close(); await b.close()
    run(main)


def test_cancel_frees_expected_buffers_and_late_transfers_are_dropped():
    async def main() -> None:
        a, b = await pair()
        arrival = b.expect(4, "r", [torch.empty(1000)])
        b.cancel("r")
        assert arrival.cancelled() and b.pending() == (0, 0)
        await a.send(b.address, 4, "r", [torch.ones(1000)])
        await a.send(b.address, 5, "other", [torch.ones(1)])  # ordered after the late one
        assert (await b.expect(5, "other", None)).nbytes == 4
        assert b.counters.dropped == 1 and b.pending() == (0, 0)
        await a.close(); await b.close()
    run(main)


def test_sending_to_a_dead_peer_raises_connection_error():
    async def main() -> None:
        a, b = await pair()
        address = b.address
        await b.close()
        with pytest.raises(ConnectionError):
            await a.send(address, 1, "r", [torch.ones(2)])
        await a.close()
    run(main)


def test_a_segment_tuple_round_trips_and_its_specs_are_known_in_advance():
    layout = SegmentLayout((LinearShape(get_family("gdn"), 4, 8, 8, 24, 4),) * 3, num_full=1, kv_heads=2,
                           head_dim=16, state_dtype=torch.bfloat16, model_dtype=torch.float32)
    store = SegmentStore(layout, 1 << 20, "cpu")
    interior, g = (8, 20), torch.Generator().manual_seed(1)
    tup = SegmentTuple(interior, *[[torch.randn(*shape, generator=g) for _ in range(n)] for shape, n in (
        (layout.t_shape(0), 3), (layout.s0_shape(0), 3), (layout.conv_shape(0), 3), ((12, 2, 16), 1), ((12, 2, 16), 1))])
    key = SegmentKey.of("fp", 8, None, token_bytes([1, 2, 3]))
    assert store.put(key, tup)
    entry = store.get(key)
    stored = SegmentTuple(entry.interior, [entry.T(i) for i in range(3)], [entry.S0(i) for i in range(3)],
                          [entry.conv_tail(i) for i in range(3)], [entry.K(0)], [entry.V(0)])
    flat = tuple_tensors(stored)
    assert [spec_of(t) for t in flat] == tuple_specs(layout, 12)
    back = tuple_from([t.contiguous() for t in flat], tuple_meta(stored))
    assert back.interior == interior and len(back.T) == 3 and len(back.K) == 1
    assert all(torch.equal(x, y) for x, y in zip(tuple_tensors(back), flat))
    with pytest.raises(ValueError):
        tuple_from(flat[:-1], tuple_meta(stored))
    assert tuple_specs(layout, 12)[0] == TensorSpec("bfloat16", (4, 8, 8))
