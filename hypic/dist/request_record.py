"""What the router keeps about one request while it is in the cluster.

The routing (`request_runner.py`) moves it between nodes; the ledger (`ledger.py`) charges its load
to the node generating it and turns its life into statistics. Both read and write this record.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypic.dist.cluster import NodeHandle
from hypic.dist.dispatch import Dispatch
from hypic.dist.stats import DistTimings
from hypic.engine.client import GenerateRequest
from hypic.engine.pic.plan import SegmentJob
from hypic.outputs import RequestOutput


@dataclass(eq=False)
class RequestRecord:
    request: GenerateRequest
    arrival: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (node_id, Output | Failed | DOWN)
    node: NodeHandle | None = None  # the node generating it
    dispatch_task: asyncio.Task | None = None
    dispatch: Dispatch | None = None
    timings: DistTimings | None = None
    segments: list[SegmentJob] = field(default_factory=list)
    prefix_hashes: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generate_sent: float = 0.0
    first_token: float | None = None
    done: bool = False
    aborted: bool = False
    charged: NodeHandle | None = None  # node whose load counts this request
    charged_tokens: int = 0  # of its pending_tokens, this request's prompt (until the first token)
    generated: dict[int, list[int]] = field(default_factory=dict)  # completion -> the ids relayed so far
    finished: set[int] = field(default_factory=set)  # completions that ended

    def took(self, output: RequestOutput) -> None:
        """Notes what an output relayed: a node that dies later resumes the request from here."""
        for delta in output.deltas:
            self.generated.setdefault(delta.index, []).extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.finished.add(delta.index)

    def resume(self) -> dict[int, list[int]]:
        """Each unfinished completion's ids so far; empty before the first output (a fresh start)."""
        if not self.generated:
            return {}
        return {i: self.generated.get(i, []) for i in range(self.request.params.n) if i not in self.finished}
