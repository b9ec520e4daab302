"""Load charging and statistics of the requests the router runs.

A request loads the node generating it (one running request, plus its prompt's prefill tokens
until its first token) so that routing sees current loads; its outputs get router-clock times and
its segment-gathering breakdown; when it leaves, its figures are added to the cluster's totals.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from hypic.dist.cluster import Cluster, NodeHandle
from hypic.dist.request_record import RequestRecord
from hypic.dist.stats import DistRequestMetrics, DistStats, DistTimings, sum_counters
from hypic.outputs import CompletionDelta, RequestOutput


@dataclass
class _Totals:
    requests_local: int = 0
    requests_distributed: int = 0
    combine_retries: int = 0
    resumed: int = 0
    sums: dict[str, float] = field(default_factory=dict)  # DistTimings fields summed over requests


class Ledger:
    def __init__(self) -> None:
        self._totals = _Totals()

    # -- load -------------------------------------------------------------------------------------

    def charge(self, record: RequestRecord, node: NodeHandle) -> None:
        self.uncharge(record)
        node.running += 1
        node.pending_tokens += record.prompt_tokens
        record.charged, record.charged_tokens = node, record.prompt_tokens

    def uncharge(self, record: RequestRecord) -> None:
        if record.charged is not None:
            self._uncharge_prompt(record)
            record.charged.running -= 1
            record.charged = None

    def _uncharge_prompt(self, record: RequestRecord) -> None:
        """At the first token: the prompt's prefill no longer loads the node."""
        if record.charged is not None:
            record.charged.pending_tokens -= record.charged_tokens
            record.charged_tokens = 0

    # -- outputs ----------------------------------------------------------------------------------

    def rewrite(self, record: RequestRecord, output: RequestOutput) -> RequestOutput:
        """Times on the router's clock (arrival here, first token as seen here) + the breakdown."""
        now = time.monotonic()
        if any(d.token_ids for d in output.deltas):
            self._uncharge_prompt(record)  # also on the first output after a resume elsewhere
        if record.first_token is None and any(d.token_ids for d in output.deltas):
            record.first_token = now
            if record.timings is not None:
                record.timings = dataclasses.replace(record.timings, combine_s=now - record.generate_sent)
        m = output.metrics
        values = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        values.update(arrival_time=record.arrival,
                      queue_time=None if m.queue_time is None else m.queue_time + record.generate_sent - record.arrival,
                      ttft=None if record.first_token is None else record.first_token - record.arrival,
                      dist=record.timings)
        return dataclasses.replace(output, metrics=DistRequestMetrics(**values))

    def abort_output(self, record: RequestRecord) -> RequestOutput:
        deltas = tuple(CompletionDelta(i, "", (), None, "abort") for i in range(record.request.params.n)
                       if i not in record.finished)
        record.done = True
        metrics = DistRequestMetrics(record.arrival, prompt_tokens=record.prompt_tokens, dist=record.timings)
        return RequestOutput(record.request.request_id, deltas, True, metrics)

    # -- totals -----------------------------------------------------------------------------------

    def retried(self, record: RequestRecord) -> None:
        """Its node went down under it: it starts again elsewhere, or resumes if it had output."""
        if record.generated:
            self._totals.resumed += 1
        else:
            self._totals.combine_retries += 1

    def count(self, record: RequestRecord) -> None:
        if record.timings is None:
            self._totals.requests_local += record.node is not None
            return
        self._totals.requests_distributed += 1
        for f in dataclasses.fields(DistTimings):
            value = getattr(record.timings, f.name)
            if f.name != "combine_node" and isinstance(value, (int, float)):
                self._totals.sums[f.name] = self._totals.sums.get(f.name, 0) + value

    def dist_stats(self, cluster: Cluster, node_restarts: int) -> DistStats:
        s, t = self._totals.sums, self._totals
        return DistStats(
            nodes_live=len(cluster.usable()), nodes_known=len(cluster.nodes),
            requests_local=t.requests_local, requests_distributed=t.requests_distributed,
            segments_local=int(s.get("segments_local", 0)), segments_pulled=int(s.get("segments_pulled", 0)),
            segments_built=int(s.get("segments_built", 0)), segments_remote=int(s.get("segments_remote", 0)),
            segments_redispatched=int(s.get("segments_redispatched", 0)), node_deaths=cluster.deaths,
            node_hangs=cluster.hangs, node_restarts=node_restarts,
            segment_errors=int(s.get("segment_errors", 0)), segment_timeouts=int(s.get("segment_timeouts", 0)),
            combine_retries=t.combine_retries, requests_resumed=t.resumed, transfer_bytes=int(s.get("transfer_bytes", 0)),
            plan_seconds=s.get("plan_s", 0.0), dispatch_seconds=s.get("dispatch_s", 0.0),
            comm_seconds=s.get("comm_s", 0.0), combine_seconds=s.get("combine_s", 0.0),
            nodes=sum_counters([n.counters for n in cluster.alive()]))
