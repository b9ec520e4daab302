"""A cluster's processes on this host: one engine process per GPU (or N CPU processes), supervised
(`hypic.dist.client.start_cluster` builds the client over them).

Processes are started with multiprocessing's 'spawn' method (CUDA cannot be forked). A node that
dies after it joined is started again under the same id and rejoins; one that dies before it ever
joined fails the start (its traceback is in the log).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hypic.config import EngineConfig
from hypic.dist.cluster import Cluster
from hypic.dist.config import DistConfig
from hypic.dist.worker import NodeSpec, node_main
from hypic.errors import InvalidRequestError

log = logging.getLogger("hypic.dist")
_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class NodePlan:
    node_id: int
    config: EngineConfig
    gpu: int | None  # physical GPU; the process sees only it
    threads: int | None  # torch threads of a CPU node
    after: int | None = None  # a node sharing the GPU that must have joined before this one starts


def plan_nodes(config: EngineConfig, workers: int, gpus: list[int] | None, device: str,
               transport: str) -> tuple[list[NodePlan], str]:
    if workers < 1:
        raise InvalidRequestError(f"workers must be at least 1, got {workers}")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if gpus:
            raise InvalidRequestError("--gpus needs --device cuda (or auto on a machine with GPUs)")
        threads = max(1, (os.cpu_count() or 1) // workers)
        plans = [NodePlan(i, dataclasses.replace(config, device="cpu"), None, threads) for i in range(workers)]
        return plans, _transport(transport, distinct_gpus=False)
    assignment = _gpu_assignment(workers, gpus, device)
    share = Counter(assignment)
    previous: dict[int, int] = {}  # gpu -> the last node planned on it
    plans = []
    for i, gpu in enumerate(assignment):
        fraction = config.gpu_memory_utilization / share[gpu]
        plans.append(NodePlan(i, dataclasses.replace(config, device="cuda:0", gpu_memory_utilization=fraction),
                              gpu, None, previous.get(gpu)))
        previous[gpu] = i
    return plans, _transport(transport, distinct_gpus=len(share) == len(assignment) > 1)


def _gpu_assignment(workers: int, gpus: list[int] | None, device: str) -> list[int]:
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise InvalidRequestError(f"device {device!r} was asked for but no CUDA device is available")
    if gpus is None:
        index = device.partition(":")[2]
        gpus = [int(index)] if index else list(range(min(workers, count)))
    missing = [g for g in gpus if not 0 <= g < count]
    if not gpus or missing:
        raise InvalidRequestError(f"GPUs {missing or gpus} do not exist here ({count} visible)")
    return [gpus[i % len(gpus)] for i in range(max(workers, len(gpus)))]


def _transport(requested: str, *, distinct_gpus: bool) -> str:
    if requested == "nccl" and not distinct_gpus:
        raise InvalidRequestError("the nccl transport needs one GPU per node (NCCL refuses two ranks on one "
                                  "GPU, and CPU nodes have none); use --transport tcp")
    if requested == "auto":
        return "nccl" if distinct_gpus else "tcp"
    return requested


class LocalNodes:
    """The engine processes of this host: spawned, watched, restarted."""

    def __init__(self, plans: list[NodePlan], dist: DistConfig, transport: str,
                 configure: Callable[[EngineConfig], EngineConfig] | None = None) -> None:
        self.plans = {plan.node_id: plan for plan in plans}
        self.dist, self.transport, self.configure = dist, transport, configure
        self.restarts = 0
        self.failed: str | None = None  # why the cluster cannot come up
        self._processes: dict[int, multiprocessing.Process] = {}
        self._ever_joined: set[int] = set()
        self._failures: Counter[int] = Counter()  # deaths since the node last joined
        self._stopping = False

    @property
    def count(self) -> int:
        return len(self.plans)

    def pid(self, node_id: int) -> int | None:
        process = self._processes.get(node_id)
        return process.pid if process is not None else None

    async def start(self, router_address: str, cluster: Cluster) -> None:
        self._router_address, self._cluster = router_address, cluster
        self._loop = asyncio.get_running_loop()
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by every node
        for plan in self.plans.values():
            if plan.after is None:
                self._spawn(plan.node_id)

    def joined(self, node_id: int) -> None:
        """Engines sharing a GPU size their memory from what is free, so they start one at a time."""
        first_join = node_id not in self._ever_joined
        self._ever_joined.add(node_id)
        self._failures[node_id] = 0
        for plan in self.plans.values():
            if first_join and plan.after == node_id and plan.node_id not in self._processes:
                self._spawn(plan.node_id)

    def expect_exit(self) -> None:
        """The nodes are about to be told to exit: stop restarting them."""
        self._stopping = True
        for process in self._processes.values():
            self._loop.remove_reader(process.sentinel)

    async def stop(self) -> None:
        """Wait for the nodes to exit (they were told to); terminate those that do not."""
        self.expect_exit()
        await asyncio.to_thread(self._reap)

    def _reap(self) -> None:
        for process in self._processes.values():
            process.join(_STOP_TIMEOUT_S)
            if process.is_alive():
                log.warning("node process %d did not exit; terminating it", process.pid)
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()

    def _spawn(self, node_id: int) -> None:
        plan = self.plans[node_id]
        spec = NodeSpec(self._router_address, plan.config, node_id=node_id, gpu=plan.gpu, transport=self.transport,
                        data_host=self.dist.data_host, heartbeat_s=self.dist.heartbeat_s,
                        affinity_granularity=self.dist.affinity_granularity, threads=plan.threads,
                        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                        configure=self.configure, detach=True)
        process = multiprocessing.get_context("spawn").Process(target=node_main, args=(spec,), daemon=True,
                                                               name=f"hypic-node{node_id}")
        process.start()
        self._processes[node_id] = process
        self._loop.add_reader(process.sentinel, self._exited, node_id, process)

    def _exited(self, node_id: int, process: multiprocessing.Process) -> None:
        self._loop.remove_reader(process.sentinel)
        process.join()
        if self._stopping:
            return
        self._failures[node_id] += 1
        if node_id not in self._ever_joined:
            self.failed = f"engine node {node_id} exited with code {process.exitcode} before joining (see its log)"
        elif not self.dist.restart_nodes or self._failures[node_id] > self.dist.max_restarts:
            log.error("node %d exited with code %s; not restarting it", node_id, process.exitcode)
        else:
            log.warning("node %d exited with code %s; restarting it", node_id, process.exitcode)
            self.restarts += 1
            self._spawn(node_id)
        asyncio.ensure_future(self._cluster.notify())
