"""Laying nodes out on a host: CPU threads, GPU round robin and shares, transport choice, refusals;
the cluster's merged stats and its Prometheus view."""
from __future__ import annotations

from unittest import mock

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hypic.config import EngineConfig
from hypic.dist.config import DistConfig
from hypic.dist.launch import plan_nodes
from hypic.dist.messages import NodeCounters
from hypic.dist.metrics import DistCollector
from hypic.dist.stats import DistStats, cluster_stats, merge_engine_stats, sum_counters
from hypic.errors import InvalidRequestError


def test_cpu_nodes_split_the_cores_and_talk_tcp():
    with mock.patch("os.cpu_count", return_value=8):
        plans, transport = plan_nodes(EngineConfig(), 3, None, "cpu", "auto")
    assert [(p.node_id, p.gpu, p.threads, p.config.device) for p in plans] == [(i, None, 2, "cpu") for i in range(3)]
    assert transport == "tcp"


def test_gpus_are_dealt_round_robin_and_sharers_split_memory_and_start_in_turn():
    with mock.patch("torch.cuda.device_count", return_value=4):
        plans, transport = plan_nodes(EngineConfig(gpu_memory_utilization=0.8), 3, [2, 3], "cuda", "auto")
        assert [(p.gpu, p.after, p.config.gpu_memory_utilization) for p in plans] == [
            (2, None, 0.4), (3, None, 0.8), (2, 0, 0.4)]
        assert transport == "tcp"  # two nodes on one GPU: NCCL would refuse
        plans, transport = plan_nodes(EngineConfig(), 4, None, "cuda", "auto")
        assert [p.gpu for p in plans] == [0, 1, 2, 3] and transport == "nccl"
        assert all(p.config.device == "cuda:0" for p in plans)  # each process sees only its GPU
        plans, _ = plan_nodes(EngineConfig(), 1, None, "cuda:3", "auto")
        assert [p.gpu for p in plans] == [3]


@pytest.mark.parametrize("args", [
    (0, None, "cpu", "auto"),
    (2, [0], "cpu", "auto"),
    (2, None, "cpu", "nccl"),
    (2, [0, 9], "cuda", "auto"),
    (2, [0], "cuda", "nccl"),
])
def test_impossible_layouts_are_refused_with_a_reason(args):
    with mock.patch("torch.cuda.device_count", return_value=2), pytest.raises(InvalidRequestError):
        plan_nodes(EngineConfig(), *args)


def test_dist_config_checks_its_values():
    for bad in (dict(transport="udp"), dict(assignment="random"), dict(heartbeat_s=0),
                dict(heartbeat_s=1.0, node_timeout_s=1.5)):
        with pytest.raises(InvalidRequestError):
            DistConfig(**bad)


def test_stats_of_nodes_are_summed_and_exported():
    one = msgspec.to_builtins(merge_engine_stats([]))  # every field, zero
    one.update(running=1, kv_blocks_total=10, block_size=16)
    one["prefix_cache"]["hits"] = 3
    merged = merge_engine_stats([one, one])
    assert (merged.running, merged.kv_blocks_total, merged.block_size, merged.prefix_cache.hits) == (2, 20, 16, 6)
    assert merge_engine_stats([]).running == 0
    counters = sum_counters([NodeCounters(bytes_sent=5, send_seconds=0.5)] * 2)
    assert counters.bytes_sent == 10 and counters.send_seconds == 1.0
    stats = cluster_stats(merged, DistStats(nodes_live=2, requests_distributed=3, nodes=counters))
    assert msgspec.to_builtins(stats)["dist"]["nodes_live"] == 2
    registry = CollectorRegistry()
    registry.register(DistCollector(lambda: stats))
    text = generate_latest(registry).decode()
    assert "hypic_dist_nodes_live 2.0" in text and "hypic_dist_requests_distributed_total 3.0" in text
    assert "hypic_dist_node_bytes_sent_total 10.0" in text
