"""Prometheus metrics of one server, under vLLM's names wherever vLLM has the metric.

A dashboard built for vLLM (vllm:* series filtered by model_name) reads a hypic server as it is;
what only hypic has (state slots, the PIC segment pool and its host and disk tiers, per-cache token counts, the cluster, GPU
memory) keeps hypic_* names. docs/metrics.md lists every series with its type, labels and the name
it had before. Every series carries `model_name`, the name the server answers to.

Counters and histograms are fed by the outputs as they pass through the server; gauges and the
engine's own counters (cache hits, preemptions) are read from the engine client's stats at scrape
time, so they are never stale and cost nothing between scrapes.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hypic.dist.metrics import DistCollector
from hypic.outputs import RequestMetrics, RequestOutput
from hypic.serve.gpu_metrics import GpuCollector

if TYPE_CHECKING:
    from hypic.engine.llm_engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_CUMULATIVE = frozenset({"hits", "misses", "hit_tokens", "evictions", "promotions", "demotions", "errors",
                         "recomputed", "late", "no_room"})  # cache stats that only grow: counters


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], device: str, model_name: str) -> None:
        series = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter("hypic_http_requests", "HTTP requests answered, by endpoint and status",
                                     ["endpoint", "status"], registry=series)
        self._finished = Counter("vllm:request_success", "Completions finished, by reason", ["finished_reason"],
                                 registry=series)
        self._latencies = _Latencies(series)
        self._tokens = _Tokens(series)
        series.register(EngineStatsCollector(stats))
        series.register(DistCollector(stats))  # segment-parallel counters; nothing for one engine
        if device.startswith("cuda"):
            series.register(GpuCollector(device))
        self.registry = CollectorRegistry()
        self.registry.register(WithLabel(series, "model_name", model_name))

    def observe(self, output: RequestOutput) -> None:
        """Record one output of a request as the server passes it on."""
        for delta in output.deltas:
            if delta.finish_reason is not None:
                self._finished.labels(delta.finish_reason).inc()
        self._latencies.observe_step(output.metrics)
        if output.finished:
            self._latencies.observe_finished(output.metrics)
            self._tokens.observe_finished(output.metrics)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Latencies:
    """Histograms of a request's times (seconds), as vLLM splits them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, documentation: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, documentation, buckets=buckets, registry=registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first output token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Between a request's token steps", _STEP_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "First to last token over the steps between them, per request", _STEP_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last output")
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled")
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first output token")
        self.decode = histogram("vllm:request_decode_time_seconds", "First output token to last")

    def observe_step(self, metrics: RequestMetrics) -> None:
        if metrics.inter_token_latency is not None:
            self.itl.observe(metrics.inter_token_latency)

    def observe_finished(self, m: RequestMetrics) -> None:
        self.e2e.observe(time.monotonic() - m.arrival_time)
        for histogram, seconds in ((self.ttft, m.ttft), (self.queue, m.queue_time), (self.decode, m.decode_time)):
            if seconds is not None:
                histogram.observe(seconds)
        if m.ttft is not None and m.queue_time is not None:
            self.prefill.observe(m.ttft - m.queue_time)
        if m.decode_time is not None and m.token_steps > 1:
            self.tpot.observe(m.decode_time / (m.token_steps - 1))


class _Tokens:
    """Token counts of finished requests: totals, per-request histograms and cache hits."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation = Counter("vllm:generation_tokens", "Tokens generated by finished requests", registry=registry)
        self.per_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request",
                                    buckets=_TOKEN_BUCKETS, registry=registry)
        self.per_generation = Histogram("vllm:request_generation_tokens", "Tokens generated per finished request",
                                        buckets=_TOKEN_BUCKETS, registry=registry)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens of finished requests (looked up)",
                                      registry=registry)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Of those, tokens served by the exact-prefix cache",
                                   registry=registry)
        self.cached = Counter("hypic_cached_prompt_tokens", "Prompt tokens served from a cache, by cache kind",
                              ["kind"], registry=registry)

    def observe_finished(self, m: RequestMetrics) -> None:
        self.prompt.inc(m.prompt_tokens)
        self.generation.inc(m.generated_tokens)
        self.per_prompt.observe(m.prompt_tokens)
        self.per_generation.observe(m.generated_tokens)
        self.prefix_queries.inc(m.prompt_tokens)
        self.prefix_hits.inc(m.cached_tokens_by_kind.get("prefix", 0))
        for kind, tokens in m.cached_tokens_by_kind.items():
            self.cached.labels(kind).inc(tokens)


class EngineStatsCollector(Collector):
    """Gauges and engine counters read from the engine's stats at every scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield _gauge("vllm:num_requests_running", "Requests being generated", s.running)
        yield _gauge("vllm:num_requests_waiting", "Requests queued for admission", s.waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use", _used(s.kv_blocks_free, s.kv_blocks_total))
        yield CounterMetricFamily("vllm:num_preemptions", "Sequences preempted (recomputed later)", value=s.preemptions)
        yield CounterMetricFamily("hypic_steps_out_of_memory", "Engine steps that ran out of device memory (their "
                                  "requests failed with a 503, the engine went on)", value=s.steps_out_of_memory)
        yield _gauge("hypic_kv_blocks", "KV-cache pages", s.kv_blocks_total)
        yield _gauge("hypic_kv_blocks_free", "KV-cache pages free", s.kv_blocks_free)
        yield _gauge("hypic_kv_block_size_tokens", "Tokens per KV-cache page", s.block_size)
        yield _gauge("hypic_state_slots", "Linear-attention state slots", s.state_slots_total)
        yield _gauge("hypic_state_slots_free", "Linear-attention state slots free", s.state_slots_free)
        yield _gauge("hypic_state_slot_usage_ratio", "Fraction of state slots in use",
                     _used(s.state_slots_free, s.state_slots_total))
        yield from _cache_families("prefix_cache", "Prefix cache", s.prefix_cache)
        yield from _cache_families("segment_pool", "Segment pool (PIC)", s.segment_pool)
        yield from _cache_families("segment_host", "Segment host-memory tier", s.segment_host)
        yield from _cache_families("segment_disk", "Segment disk tier", s.segment_disk)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # dynamic: nothing to check at registration


class WithLabel(Collector):
    """Every series of a registry with one more label (prometheus_client has no constant labels)."""

    def __init__(self, registry: CollectorRegistry, name: str, value: str) -> None:
        self._registry, self._label = registry, {name: value}

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**s.labels, **self._label}) for s in family.samples]
            yield labelled

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


def _used(free: int, total: int) -> float:
    return 1.0 - free / total if total else 0.0


def _cache_families(name: str, title: str, stats: object) -> Iterator[Metric]:  # any dataclass of counts
    """Every numeric field of a cache's stats as hypic_<name>_<field>: counters for what only grows."""
    if not dataclasses.is_dataclass(stats):
        return
    for item in dataclasses.fields(stats):
        value = getattr(stats, item.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if item.name in _CUMULATIVE:
            yield CounterMetricFamily(f"hypic_{name}_{item.name}", f"{title}: {item.name}", value=value)
        else:
            yield _gauge(f"hypic_{name}_{item.name}", f"{title}: {item.name}", value)
