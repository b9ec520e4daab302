"""One engine node: an AsyncEngine, its tensor transport, and its connection to the router.

A node serves its own requests (it is their combine node: `Generate` -> `Output`s) and prefills or
ships segments for other nodes' requests (`SegmentWork`). It joins by connecting to the router's
address and saying `Hello` — a restarted node does the same and rejoins — then heartbeats its stats,
and starts its pulse (`pulse.py`), which tells the router it is busy, not hung, while long work
holds its event loop.
It exits when told to (`Shutdown`) or when the router goes away.

Started by `hypic.dist.launch` (multiprocessing, spawn), or by hand on another machine:
    python -m hypic.dist.worker --router tcp://HOST:PORT --model DIR --device cuda:0
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from hypic.config import EngineConfig
from hypic.dist.pulse import start_pulse
from hypic.dist.affinity import prefix_hashes
from hypic.dist.link import Link
from hypic.dist.messages import (NODE_CODEC, Abort, Build, Cancel, Expect, Failed, Generate, Heartbeat,
                                 Flush, FlushReply, Hello, Output, Plan, PlanReply, Probe, ProbeReply, Pull,
                                 Shutdown, TierMove, TierMoves, Welcome, read_message, write_message)
from hypic.dist.net import connect
from hypic.dist.remote_errors import error_info
from hypic.dist.segment_wire import key_ref, planned_job
from hypic.dist.segment_work import SegmentWork
from hypic.dist.transport import TensorTransport
from hypic.engine.async_engine import AsyncEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.errors import EngineDeadError, HypicError, PromptTooLongError

log = logging.getLogger("hypic.dist")


@dataclass(frozen=True)
class NodeSpec:
    router_address: str
    config: EngineConfig  # its device is the node's own ("cuda" when `gpu` narrows the visible set)
    node_id: int = -1  # -1: the router picks one
    gpu: int | None = None  # physical GPU index: the only one this process sees
    transport: str = "tcp"
    data_host: str = "127.0.0.1"
    heartbeat_s: float = 0.5
    affinity_granularity: int = 64
    threads: int | None = None  # torch intra-op threads (CPU nodes sharing a host)
    log_level: str = "WARNING"
    configure: Callable[[EngineConfig], EngineConfig] | None = None
    """Runs in the node process before its engine is built (picklable: a module-level function),
    e.g. to put in-memory weights into the config."""
    detach: bool = False
    """Leave the terminal's process group: Ctrl-C reaches the router, which drains the requests and
    then stops this node (a node also exits by itself when its router goes away)."""


def node_main(spec: NodeSpec) -> None:
    """Process entry point."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # point-to-point never needs NVLink multicast
    if spec.detach and hasattr(os, "setpgrp"):
        os.setpgrp()
    if spec.gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)  # before the first CUDA call
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s node{spec.node_id} %(levelname)s %(message)s")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.configure is not None:
        spec = dataclasses.replace(spec, config=spec.configure(spec.config))
    code = _run(EngineNode(spec).run())
    logging.shutdown()
    os._exit(code)  # everything is closed; skip the interpreter's slow teardown of torch


def make_transport(kind: str, device: torch.device) -> TensorTransport:
    if kind == "nccl":
        from hypic.dist.nccl_transport import NcclTransport

        return NcclTransport(device)
    from hypic.dist.tcp_transport import TcpTransport

    return TcpTransport()


class EngineNode:
    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.node_id = spec.node_id
        self.engine = AsyncEngine(spec.config)
        self._tasks: set[asyncio.Task] = set()
        self._grace_s = 0.0

    async def run(self) -> int:
        self._stop = asyncio.Event()
        await self.engine.start()
        self.transport = make_transport(self.spec.transport, self.engine.device)
        await self.transport.start(f"tcp://{self.spec.data_host}:0")
        self.link = await self._join()
        self.pulse = start_pulse(self.spec.router_address, self.node_id, self.spec.heartbeat_s)
        self.work = SegmentWork(self.node_id, self.engine, self.transport, self.link.send)
        self.link.start()
        waits = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self.link.closed.wait()),
                 asyncio.create_task(self._stop.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)  # told to stop, or the router is gone
        for task in waits:
            task.cancel()
        await self._close()
        return 0

    async def _join(self) -> Link:
        reader, writer = await connect(self.spec.router_address)
        hello = Hello(self.node_id, os.getpid(), self._device_name(), self.transport.address, self.transport.name,
                      self.engine.model_name, self.engine.max_model_len)
        await write_message(writer, hello, NODE_CODEC)
        welcome = await read_message(reader, NODE_CODEC)
        if not isinstance(welcome, Welcome):
            raise ConnectionError(f"the router answered Hello with {type(welcome).__name__}")
        self.node_id = welcome.node_id
        return Link(reader, writer, NODE_CODEC, self._on_message, f"router<-node{self.node_id}")

    def _device_name(self) -> str:
        device = self.engine.device
        return "cpu" if device.type == "cpu" else f"cuda:{self.spec.gpu if self.spec.gpu is not None else device.index or 0}"

    async def _close(self) -> None:
        self.work.close()
        for task in list(self._tasks):
            task.cancel()
        await self.engine.shutdown(self._grace_s)
        await self.transport.close()
        self.link.close()
        if self.pulse is not None:
            self.pulse.terminate()
            await asyncio.to_thread(self.pulse.wait)

    # -- messages ---------------------------------------------------------------------------------

    def _on_message(self, message: Any) -> None:
        match message:
            case Generate():
                self._spawn(self._generate(message))
            case Abort():
                self._spawn(self.engine.abort(message.request_id))
            case Plan():
                self._spawn(self.link.send(self._plan(message)))
            case Build():
                self.work.build(message)
            case Pull():
                self.work.pull(message)
            case Expect():
                self.work.expect(message)
            case Cancel():
                self.work.cancel(message.request_id)
            case Probe():
                self._spawn(self.link.send(ProbeReply(message.call_id, self._stats(), self.work.counters())))
            case Flush():
                self._spawn(self._flush(message))
            case Shutdown():
                self._grace_s = message.grace_s
                self._stop.set()
            case _:
                log.warning("node %d ignores %s", self.node_id, type(message).__name__)

    async def _flush(self, message: Flush) -> None:
        await self.link.send(FlushReply(message.call_id, await self.engine.flush_segments(message.salt)))

    async def _generate(self, message: Generate) -> None:
        outputs = self.engine.generate(message.prompt, message.params, request_id=message.request_id,
                                       cache_salt=message.cache_salt, cache_mode=message.cache_mode,
                                       add_special_tokens=message.add_special_tokens,
                                       resume=message.resume or None)
        try:
            async with aclosing(outputs):  # leaving early (router gone) aborts the request here
                async for output in outputs:
                    await self.link.send(Output(message.request_id, output))
        except ConnectionError:
            pass
        except Exception as error:  # noqa: BLE001 - typed errors cross to the router; bugs are logged
            if not isinstance(error, HypicError):
                log.exception("request %s failed on node %d", message.request_id, self.node_id)
            await self._send_quietly(Failed(message.request_id, error_info(error)))

    def _plan(self, message: Plan) -> PlanReply:
        try:  # tokenized once: a long prompt's tokenization is a good part of the plan's time
            prompt = SegmentedPrompt.build(self.engine.tokenizer, message.prompt,
                                           separator=self.engine.config.segment_separator,
                                           add_special_tokens=message.add_special_tokens)
            _check_length(prompt.num_tokens, message.max_tokens, self.engine.max_model_len)
            jobs = self.engine.segment_jobs(prompt, cache_salt=message.cache_salt, cache_mode=message.cache_mode)
        except HypicError as error:
            return PlanReply(message.call_id, error=error_info(error))
        hashes = prefix_hashes(prompt.token_ids, message.cache_salt, self.spec.affinity_granularity)
        planned = [planned_job(job) for job in jobs]
        return PlanReply(message.call_id, prompt.num_tokens, planned, hashes)

    async def _heartbeats(self) -> None:
        while True:
            await self._send_quietly(Heartbeat(self._stats(), self.work.counters()))
            await self._report_tier_moves()
            await asyncio.sleep(self.spec.heartbeat_s)

    async def _report_tier_moves(self) -> None:
        """The keys whose best tier changed here, for the router's segment directory."""
        try:
            moves = await self.engine.segment_moves()
        except EngineDeadError:
            return  # the heartbeats go on: the router learns of the dead engine from its requests
        if moves:
            await self._send_quietly(TierMoves([TierMove(key_ref(k), tier) for k, tier in moves.items()]))

    def _stats(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.engine.stats())

    async def _send_quietly(self, message: msgspec.Struct) -> None:
        try:
            await self.link.send(message)
        except ConnectionError:
            pass  # the router is gone; run() is closing this node

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _check_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The engine's own admission rule, checked before segments are prefilled for nothing."""
    if prompt_tokens >= max_model_len or prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(prompt_tokens, max_model_len, max_tokens)


def _run(main: Any) -> int:
    if sys.platform == "win32":
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    """Join a running router from this machine (the router's host must reach --data-host)."""
    parser = argparse.ArgumentParser(prog="python -m hypic.dist.worker", description=main.__doc__)
    parser.add_argument("--router", required=True, help="the router's address, tcp://HOST:PORT")
    parser.add_argument("--model", help="model directory (the router's model)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--gpu", type=int, help="physical GPU index this node owns")
    parser.add_argument("--transport", choices=("tcp", "nccl"), default="tcp")
    parser.add_argument("--data-host", default="127.0.0.1", help="address peers reach this node's data plane at")
    parser.add_argument("--node-id", type=int, default=-1)
    args = parser.parse_args(argv)
    config = dataclasses.replace(EngineConfig(), model=args.model, device="cuda" if args.gpu is not None else args.device)
    node_main(NodeSpec(args.router, config, args.node_id, args.gpu, args.transport, args.data_host, log_level="INFO"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
