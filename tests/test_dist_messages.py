"""Control plane: every message survives the codec; framing over real TCP and unix sockets; calls."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from hypic.dist.link import Link
from hypic.dist.messages import (DATA_CODEC, MAX_FRAME_BYTES, NODE_CODEC, Abort, Arrived, Build, Cancel,
                                 ErrorInfo, Expect, Failed, Generate, Heartbeat, Hello, Job, KeyRef, NcclHello,
                                 NodeCounters, Output, Plan, PlannedJob, PlanReply, Probe, ProbeReply, Progress,
                                 ProtocolError, Pull, Shutdown, TensorSpec, TierMove, TierMoves, TransferHeader,
                                 Welcome, frame,
                                 read_frame, read_message, write_message)
from hypic.dist.net import Address, connect, listen
from hypic.outputs import CompletionDelta, RequestMetrics, RequestOutput, TokenLogprob
from hypic.sampling_params import SamplingParams

KEY = KeyRef(b"\x01" * 16, "tenant")
SEGMENT = PlannedJob(KEY, (5, 6, 7, 8), (2, 3), False, "host")
OUTPUT = RequestOutput("r1", (CompletionDelta(0, "hé", (4, 9), (TokenLogprob(4, "h", -0.123456789012345678,
                                                                            ((9, "é", -2.5),)),), "stop"),),
                       True, RequestMetrics(12.5, 0.001, 0.02, 7, 3, {"pic": 3}, 2))

NODE_MESSAGES = [
    Hello(3, 1234, "cuda:3", "tcp://10.0.0.2:5000", "nccl", "tiny", 4096),
    Welcome(3),
    Heartbeat({"running": 1, "prefix_cache": {"hits": 2}}, NodeCounters(segments_built=4, send_seconds=0.5)),
    TierMoves([TierMove(KEY, "host"), TierMove(KeyRef(b"\x02" * 16, None), None)]),
    Generate("r1", ["sys", "doc", "q"], SamplingParams(temperature=0.0, max_tokens=3, stop=("x",), logprobs=1),
             "salt", "hypic", False),
    Generate("r2", [1, 2, 3], SamplingParams()),
    Generate("r3", "plain text", SamplingParams(n=2, seed=7)),
    Output("r1", OUTPUT),
    Failed("r1", ErrorInfo("PromptTooLongError", "too long", {"prompt_tokens": 9, "max_model_len": 8})),
    Abort("r1"),
    Plan(7, "a<|segment|>b", None, None),
    PlanReply(7, 12, [SEGMENT], [11, 2**64 - 1]),
    PlanReply(8, error=ErrorInfo("InvalidRequestError", "empty")),
    Build("r1", 0, "tcp://h:1", [Job(SEGMENT, 17)]),
    Pull("r1", 0, "unix:///tmp/x.sock", [Job(PlannedJob(KEY, (), (2, 3), False), 18)]),
    Expect("r1", [Job(SEGMENT, 17)]),
    Progress("r1", 17, "failed", 0.5, 0, ErrorInfo("ConnectionError", "gone")),
    Arrived("r1", 17, True, 0.25, 1 << 20),
    Cancel("r1"),
    Probe(9),
    ProbeReply(9, {"running": 0}, NodeCounters()),
    Shutdown(2.5),
]


@pytest.mark.parametrize("message", NODE_MESSAGES, ids=lambda m: type(m).__name__)
def test_node_messages_round_trip(message):
    assert NODE_CODEC.decode(NODE_CODEC.encode(message)) == message


def test_data_messages_round_trip_and_unions_stay_apart():
    header = TransferHeader(5, "r1", [TensorSpec("bfloat16", (2, 3)), TensorSpec("int64", ())], b"meta")
    hello = NcclHello(bytes(range(128)))
    for message in (header, hello):
        assert DATA_CODEC.decode(DATA_CODEC.encode(message)) == message
    with pytest.raises(ProtocolError):
        NODE_CODEC.decode(DATA_CODEC.encode(header))
    with pytest.raises(ProtocolError):
        NODE_CODEC.decode(b"\xc1garbage")


def test_invalid_sampling_params_are_refused_at_decode():
    raw = msgspec.msgpack.encode({"type": "Generate", "request_id": "r", "prompt": "p",
                                  "params": {"temperature": -1.0}})
    with pytest.raises(ProtocolError, match="temperature"):
        NODE_CODEC.decode(raw)


def test_framing_reads_whole_frames_and_refuses_oversized_or_torn_ones():
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(frame(b"abc") + frame(b"") + frame(b"x" * 70000))
        assert [await read_frame(reader) for _ in range(3)] == [b"abc", b"", b"x" * 70000]
        reader.feed_data((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(ProtocolError):
            await read_frame(reader)
        torn = asyncio.StreamReader()
        torn.feed_data(frame(b"abcdef")[:6])
        torn.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(torn)
    asyncio.run(main())
    with pytest.raises(ProtocolError):
        frame(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_addresses_parse_and_print():
    assert str(Address.parse("tcp://127.0.0.1:80")) == "tcp://127.0.0.1:80"
    assert Address.parse("tcp://[::1]:9").host == "::1"
    assert Address.parse("unix:///tmp/a.sock").path == "/tmp/a.sock"
    for bad in ("127.0.0.1:80", "tcp://host", "udp://h:1", "unix://", "tcp://h:port"):
        with pytest.raises(ValueError):
            Address.parse(bad)


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
def test_messages_cross_a_real_socket_and_calls_get_their_replies(scheme, tmp_path):
    async def main() -> None:
        address = "tcp://127.0.0.1:0" if scheme == "tcp" else f"unix://{tmp_path}/r.sock"
        served: list = []

        async def serve(reader, writer):
            served.append(await read_message(reader, NODE_CODEC))
            await write_message(writer, Welcome(1), NODE_CODEC)
            probe = await read_message(reader, NODE_CODEC)
            await write_message(writer, Abort("not a reply"), NODE_CODEC)
            await write_message(writer, ProbeReply(probe.call_id, {"running": 0}, NodeCounters()), NODE_CODEC)
            writer.close()

        server, bound = await listen(address, serve)
        reader, writer = await connect(bound)
        await write_message(writer, NODE_MESSAGES[0], NODE_CODEC)
        assert await read_message(reader, NODE_CODEC) == Welcome(1)
        others: list = []
        link = Link(reader, writer, NODE_CODEC, others.append, "test", (ProbeReply,))
        link.start()
        reply = await link.call(Probe, timeout=5.0)
        assert isinstance(reply, ProbeReply) and others == [Abort("not a reply")]
        await asyncio.wait_for(link.closed.wait(), 5.0)  # the server hung up
        with pytest.raises(ConnectionError):
            await link.call(Probe, timeout=5.0)
        assert served == [NODE_MESSAGES[0]]
        server.close()
    asyncio.run(main())


def test_a_pending_call_fails_when_the_link_closes():
    async def main() -> None:
        async def silent(reader, writer):
            await reader.read(1)  # takes the call, never answers, then hangs up
            writer.close()

        server, bound = await listen("tcp://127.0.0.1:0", silent)
        link = Link(*await connect(bound), NODE_CODEC, lambda m: None, "test", (ProbeReply,))
        link.start()
        with pytest.raises(ConnectionError):
            await link.call(Probe, timeout=5.0)
        server.close()
    asyncio.run(main())
