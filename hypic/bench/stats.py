"""Statistics of one rate point, and the sustainable rate of a sweep.

Latencies in seconds. TTFT: send to the first chunk with text; ITL: gaps between chunks with text
(pooled over requests); TPOT: (E2E - TTFT) / (output tokens - 1) per request; E2E: send to the end of
the stream. The run lasts from the first arrival to the last completion.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hypic.bench.arrivals import Dispatched
from hypic.bench.client import Outcome

QUANTILES = (50, 90, 99)
ERROR_SAMPLES = 3


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 1.0  # p50 TTFT of a sustainable rate; also each request's TTFT bound in goodput
    tpot_s: float | None = None  # each request's TPOT bound in goodput (None: not bounded)
    keep_up: float = 0.9  # a sustainable rate completes at least this fraction of the offered rate


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) with linear interpolation between order statistics
    (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(name: str, values: Sequence[float]) -> dict[str, float | None]:
    """`{name}_mean_s`, `{name}_p50_s`, `{name}_p90_s`, `{name}_p99_s`."""
    stats = {f"{name}_mean_s": sum(values) / len(values) if values else None}
    stats.update({f"{name}_p{q}_s": percentile(values, q) for q in QUANTILES})
    return stats


def tpot(outcome: Outcome) -> float | None:
    if outcome.ttft_s is None or outcome.completion_tokens < 2:
        return None
    return (outcome.e2e_s - outcome.ttft_s) / (outcome.completion_tokens - 1)


def is_good(outcome: Outcome, slo: Slo) -> bool:
    """Met every bound of the SLO (a request of one output token has no TPOT to miss)."""
    if outcome.error is not None or outcome.ttft_s is None or outcome.ttft_s > slo.ttft_s:
        return False
    per_token = tpot(outcome)
    return slo.tpot_s is None or per_token is None or per_token <= slo.tpot_s


def summarize(rate: float | None, dispatched: Sequence[Dispatched[Outcome]], slo: Slo) -> dict:
    """Every metric of one rate point (rate None: a trace's timestamps; its offered rate stands in)."""
    ok = [d.result for d in dispatched if d.result.error is None]
    errors = [d.result.error for d in dispatched if d.result.error is not None]
    rates = throughput(dispatched, ok, slo)
    return {"request_rate": rates["offered_rps"] if rate is None else rate, "requests": len(dispatched),
            "completed": len(ok), "errors": len(errors), "error_samples": errors[:ERROR_SAMPLES], **rates,
            **latencies(ok), "samples": [sample(d) for d in dispatched]}


def throughput(dispatched: Sequence[Dispatched[Outcome]], ok: Sequence[Outcome], slo: Slo) -> dict:
    """Rates over the run (first arrival to last completion) and the offered rate (arrivals / their span)."""
    arrivals = sorted(d.planned.arrival_s for d in dispatched)
    duration = max((d.sent_s + d.result.e2e_s for d in dispatched), default=0.0) - (arrivals[0] if arrivals else 0.0)
    span = arrivals[-1] - arrivals[0] if arrivals else 0.0
    prompt = sum(o.prompt_tokens for o in ok)
    return {"duration_s": duration, "offered_rps": (len(arrivals) - 1) / span if span > 0 else math.inf,
            "achieved_rps": _per_s(len(ok), duration),
            "goodput_rps": _per_s(sum(is_good(o, slo) for o in ok), duration),
            "input_tokens_per_s": _per_s(prompt, duration),
            "output_tokens_per_s": _per_s(sum(o.completion_tokens for o in ok), duration),
            "cached_token_fraction": sum(o.cached_tokens for o in ok) / prompt if prompt else None}


def latencies(ok: Sequence[Outcome]) -> dict:
    return {**distribution("ttft", [o.ttft_s for o in ok if o.ttft_s is not None]),
            **distribution("itl", [gap for o in ok for gap in o.itl_s]),
            **distribution("tpot", [t for t in map(tpot, ok) if t is not None]),
            **distribution("e2e", [o.e2e_s for o in ok])}


def sample(dispatched: Dispatched[Outcome]) -> dict:
    """One request's record (in plan order): when it arrived and went out, and what it measured."""
    outcome = dispatched.result
    return {"arrival_s": dispatched.planned.arrival_s, "sent_s": dispatched.sent_s, "ttft_s": outcome.ttft_s,
            "e2e_s": outcome.e2e_s, "tpot_s": tpot(outcome), "itl_max_s": max(outcome.itl_s, default=None),
            "prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens, "cached_tokens": outcome.cached_tokens,
            "cold_segments": dispatched.planned.request.cold_segments, "error": outcome.error}


def _per_s(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def margins(point: dict, slo: Slo) -> tuple[float, float]:
    """How far a point is inside the SLO (>= 0 on both: sustainable): p50 TTFT and keeping up."""
    ttft = point["ttft_p50_s"]
    ttft_margin = slo.ttft_s - ttft if ttft is not None else -math.inf
    offered = point["offered_rps"]
    keep_up_margin = point["achieved_rps"] / offered - slo.keep_up if math.isfinite(offered) and offered > 0 else -1.0
    return ttft_margin, keep_up_margin


def sustainable_rate(points: Sequence[dict], slo: Slo) -> dict:
    """The highest offered rate meeting the SLO, interpolated linearly between the last passing and
    the first failing sweep point on whichever margin crosses zero first. `bound`: "interpolated",
    "at_least" (every finite point passes; the rate is the highest of them) or "below_sweep". Rates
    are those the server was offered (`offered_rps`), not the sweep's nominal ones: a Poisson sweep
    point of a few dozen requests arrives up to a fifth off its nominal rate."""
    ordered = sorted(points, key=lambda point: point["request_rate"])
    passing = None
    for point in ordered:
        now = margins(point, slo)
        if min(now) < 0:
            return _crossing(passing, point, now, slo)
        passing = point
    finite = [p["offered_rps"] for p in ordered if math.isfinite(p["request_rate"])]
    return {"rate": max(finite, default=None), "bound": "at_least"}


def _crossing(passing: dict | None, failing: dict, failing_margins: tuple[float, float], slo: Slo) -> dict:
    if passing is None:
        return {"rate": 0.0, "bound": "below_sweep"}
    low, high = passing["offered_rps"], failing["offered_rps"]
    if math.isinf(failing["request_rate"]):
        return {"rate": low, "bound": "at_least"}
    crossings = [low + (high - low) * before / (before - after)
                 for before, after in zip(margins(passing, slo), failing_margins) if after < 0 and math.isfinite(after)]
    return {"rate": min(crossings, default=low), "bound": "interpolated"}


def saturation(points: Sequence[dict]) -> dict:
    """The sweep's highest achieved throughput (requests/s and output tokens/s)."""
    return {"saturated_rps": max((p["achieved_rps"] for p in points), default=0.0),
            "saturated_output_tokens_per_s": max((p["output_tokens_per_s"] for p in points), default=0.0)}
