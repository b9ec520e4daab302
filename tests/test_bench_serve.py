"""`hypic bench serve`: workloads (seeded, Zipf popularity, the same tokens in every prompt form),
statistics against hand-computed cases, arrival scheduling on an injected clock, and real runs
against the bundled model whose latency counts agree with the server's /metrics histograms."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_http import LoopThread

from hypic.bench import arrivals, client, report, stats
from hypic.bench.serve import add_bench_arguments
from hypic.bench.arrivals import Clock, Dispatched, Planned
from hypic.bench.client import Outcome, Target
from hypic.bench.workloads import BenchRequest, ChatSpec, ChatWorkload, RagSpec, RagWorkload, TraceWorkload, zipf_weights
from hypic.cli import main
from hypic.config import EngineConfig
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.setup import BUNDLED_MODEL
from hypic.engine.text.tokenizer import Tokenizer
from hypic.serve.app import build_app, runner_for
from hypic.engine.client import InProcessEngineClient
from hypic.serve.state import ServerSettings

TRACE = Path(__file__).parent / "data" / "bench_trace.jsonl"
SMALL_RAG = RagSpec(documents=12, doc_tokens=40, docs_per_request=3, system_tokens=16, question_tokens=8, max_tokens=4)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(BUNDLED_MODEL)


def take(workload: RagWorkload | ChatWorkload, count: int, key: str = "test") -> list[BenchRequest]:
    stream = workload.requests(key)
    return [next(stream) for _ in range(count)]


# ---- workloads ---------------------------------------------------------------------------------


def test_rag_stream_is_seeded_and_shaped_as_specified(tokenizer) -> None:
    first, again = take(RagWorkload(tokenizer, SMALL_RAG), 20), take(RagWorkload(tokenizer, SMALL_RAG), 20)
    assert first == again
    assert take(RagWorkload(tokenizer, RagSpec(**{**SMALL_RAG.__dict__, "seed": 1})), 20) != first
    workload = RagWorkload(tokenizer, SMALL_RAG)
    for request in first:
        system, *docs, question = request.texts
        assert system == workload.system and len(set(docs)) == 3 and set(docs) <= set(workload.documents)
        assert request.max_tokens == 4 and question.endswith("Question:")
    assert len({r.texts[-1] for r in first}) == 20  # a new question each time
    lengths = [len(tokenizer.encode(doc, add_special_tokens=False)) for doc in workload.documents]
    assert 0.8 * 40 - 1 <= min(lengths) and max(lengths) <= 1.2 * 40 + 16  # the range, plus one last sentence


def test_preheat_sends_each_document_once_without_a_question(tokenizer) -> None:
    workload = RagWorkload(tokenizer, SMALL_RAG)
    assert [r.texts for r in workload.preheat()] == [(workload.system, doc, "") for doc in workload.documents]


def test_documents_come_in_random_order(tokenizer) -> None:
    workload = RagWorkload(tokenizer, SMALL_RAG)
    ranks = [[workload.documents.index(doc) for doc in r.texts[1:-1]] for r in take(workload, 60)]
    assert sum(order == sorted(order) for order in ranks) < 30  # 1/6 of them if random; all if in popularity order


def test_popularity_follows_zipf(tokenizer) -> None:
    spec = RagSpec(documents=8, doc_tokens=4, docs_per_request=1, system_tokens=2, question_tokens=1, zipf_s=1.2)
    workload = RagWorkload(tokenizer, spec)
    draws = 4000
    counts = Counter(workload.documents.index(r.texts[1]) for r in take(workload, draws))
    expected = zipf_weights(8, 1.2)
    assert expected[0] / expected[1] == pytest.approx(2 ** 1.2)
    chi_square = sum((counts[i] - draws * p) ** 2 / (draws * p) for i, p in enumerate(expected))
    assert chi_square < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_chat_turns_resend_their_history_after_the_previous_turn(tokenizer) -> None:
    requests = take(ChatWorkload(tokenizer, ChatSpec(conversations=3, turns=3, system_tokens=8, user_tokens=6,
                                                     answer_tokens=5)), 30)
    firsts = [r for r in requests if r.after is None]
    assert all(len(r.texts) == 2 for r in firsts)
    for request in requests:
        if request.after is not None:
            previous = requests[request.after]
            assert request.texts[:-2] == previous.texts[:-1]  # system and earlier turns, resent as they were
            assert request.texts[-2].startswith(previous.texts[-1]) and len(request.texts) <= 4


def test_both_prompt_forms_carry_the_same_tokens(tokenizer) -> None:
    request = take(RagWorkload(tokenizer, SMALL_RAG), 1)[0]
    forms = {(backend, form): client.request_body(Target("u", "m", backend, form), request)[1]
             for backend in ("hypic", "openai") for form in ("ids", "text")}
    separator = "<|segment|>"
    as_server_builds = {key: SegmentedPrompt.build(tokenizer, body.get("segments") or body["prompt"], separator=separator)
                        for key, body in forms.items() if key != ("openai", "text")}
    segments = {key: built.segments for key, built in as_server_builds.items() if key[0] == "hypic"}
    assert segments[("hypic", "ids")] == segments[("hypic", "text")] == request.segments
    assert as_server_builds[("openai", "ids")].token_ids == request.token_ids
    assert forms[("openai", "text")]["prompt"] == "".join(request.texts)


def test_trace_lines_keep_their_order_and_forms(tokenizer) -> None:
    items = list(TraceWorkload(tokenizer, TRACE).requests("any"))
    assert [r.arrival_s for r in items] == [10.0, 10.25, 10.5, 11.0]
    assert items[0].segments == tuple(tuple(s) for s in SegmentedPrompt.build(
        tokenizer, ["You answer briefly.", "The old market opened at dawn.", "Where is the market?"],
        separator="<|segment|>").segments)
    assert items[1].segments == ((76, 607, 1062), (785, 1429, 1702, 13), (383, 374)) and items[1].texts is None
    assert client.request_body(Target("u", "m"), items[2])[0] == "/v1/chat/completions"
    assert [r.max_tokens for r in items] == [4, 3, 2, 5]


# ---- statistics --------------------------------------------------------------------------------


def test_percentiles_interpolate_between_order_statistics() -> None:
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert stats.percentile([5.0], 99) == 5.0 and stats.percentile([], 50) is None


def _done(arrival: float, sent: float, outcome: Outcome) -> Dispatched[Outcome]:
    return Dispatched(Planned(0, arrival, BenchRequest((), None, 4)), sent, outcome)


def test_a_rate_point_by_hand() -> None:
    good = Outcome(None, 0.2, 0.5, (0.1, 0.1, 0.1), prompt_tokens=100, completion_tokens=4, cached_tokens=60)
    slow = Outcome(None, 1.5, 2.4, (0.3, 0.3, 0.3), prompt_tokens=100, completion_tokens=4, cached_tokens=0)
    point = stats.summarize(2.0, [_done(0.0, 0.0, good), _done(1.0, 1.0, slow), _done(2.0, 2.1, Outcome("HTTP 503"))],
                            stats.Slo(ttft_s=1.0, tpot_s=0.2))
    assert point["duration_s"] == pytest.approx(3.4)  # first arrival 0 to the slow one's end at 1.0 + 2.4
    assert point["offered_rps"] == 1.0 and point["achieved_rps"] == pytest.approx(2 / 3.4)
    assert point["goodput_rps"] == pytest.approx(1 / 3.4)
    assert point["errors"] == 1 and point["error_samples"] == ["HTTP 503"]
    assert point["ttft_p50_s"] == pytest.approx(0.85) and point["ttft_mean_s"] == pytest.approx(0.85)
    assert point["tpot_p50_s"] == pytest.approx((0.1 + 0.3) / 2)  # (0.5-0.2)/3 and (2.4-1.5)/3
    assert point["itl_p50_s"] == pytest.approx(0.2) and point["e2e_p99_s"] == pytest.approx(0.5 + 1.9 * 0.99)
    assert point["input_tokens_per_s"] == pytest.approx(200 / 3.4) and point["cached_token_fraction"] == 0.3
    assert point["output_tokens_per_s"] == pytest.approx(8 / 3.4)
    assert [(s["sent_s"], s["itl_max_s"], s["error"]) for s in point["samples"]] == [
        (0.0, 0.1, None), (1.0, 0.3, None), (2.1, None, "HTTP 503")]


def _point(rate: float, ttft_p50: float, achieved: float, offered: float | None = None) -> dict:
    return {"request_rate": rate, "ttft_p50_s": ttft_p50, "offered_rps": rate if offered is None else offered,
            "achieved_rps": achieved, "output_tokens_per_s": achieved * 10}


def test_sustainable_rate_interpolates_the_first_margin_to_cross() -> None:
    slo = stats.Slo(ttft_s=1.0, keep_up=0.9)
    # TTFT crosses 1 s at 2 + 2 * 0.5 / 1.5 = 2.667; keeping up (0.95 -> 0.75 of offered) crosses 0.9 at 2.5
    points = [_point(1.0, 0.2, 1.0), _point(2.0, 0.5, 1.9), _point(4.0, 2.0, 3.0), _point(math.inf, 9.0, 3.2)]
    assert stats.sustainable_rate(points, slo) == {"rate": pytest.approx(2.5), "bound": "interpolated"}
    points[2] = _point(4.0, 2.0, 3.8)
    assert stats.sustainable_rate(points, slo)["rate"] == pytest.approx(2 + 2 / 3)
    assert stats.sustainable_rate([_point(1.0, 3.0, 1.0)], slo) == {"rate": 0.0, "bound": "below_sweep"}
    assert stats.sustainable_rate([_point(1.0, 0.1, 1.0), _point(math.inf, 5.0, 3.0)], slo) == {
        "rate": 1.0, "bound": "at_least"}
    assert stats.saturation(points) == {"saturated_rps": 3.8, "saturated_output_tokens_per_s": 38.0}


def test_sustainable_rate_is_an_offered_rate() -> None:
    """Interpolated between the rates the arrivals made (8 and 16 arrived at 7 and 12.9 a second),
    never the nominal ones: keeping up (1.0 -> 0.83 of offered) crosses 0.9 at 7 + 5.9 * 0.1 / 0.17."""
    slo = stats.Slo(ttft_s=1.0, keep_up=0.9)
    points = [_point(8.0, 0.1, 7.0, offered=7.0), _point(16.0, 0.2, 10.7, offered=12.9),
              _point(math.inf, 1.4, 10.2)]
    crossing = 7.0 + 5.9 * (1.0 - 0.9) / (1.0 - 10.7 / 12.9)
    assert stats.sustainable_rate(points, slo) == {"rate": pytest.approx(crossing), "bound": "interpolated"}
    assert stats.sustainable_rate(points[:2] + [_point(math.inf, 0.3, 10.9)], stats.Slo(keep_up=0.8)) == {
        "rate": 12.9, "bound": "at_least"}


# ---- arrivals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_the_rate_and_burstiness(burstiness: float) -> None:
    times = arrivals.arrival_times(20000, 5.0, burstiness, random.Random(0))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(burstiness ** -0.5, rel=0.08)
    assert arrivals.arrival_times(3, math.inf, burstiness, random.Random(0)) == [0.0, 0.0, 0.0]


class FakeClock:
    """Time moves only when the dispatcher sleeps until the next arrival, once every task that
    could run has run (a few passes of the event loop)."""

    def __init__(self) -> None:
        self.now = 100.0

    async def sleep(self, seconds: float) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        self.now += seconds

    def clock(self) -> Clock:
        return Clock(lambda: self.now, self.sleep)


def _plan(arrivals_s: list[float], after: dict[int, int] | None = None) -> list[Planned]:
    after = after or {}
    return [Planned(i, at, BenchRequest(((i,),), None, 1, after=after.get(i))) for i, at in enumerate(arrivals_s)]


def test_requests_go_out_at_their_arrival_times() -> None:
    fake = FakeClock()

    async def send(request: BenchRequest) -> int:
        return request.segments[0][0]

    plan = _plan([0.5, 0.0, 2.0, 2.0, 3.25])
    done = asyncio.run(arrivals.dispatch(plan, send, clock=fake.clock()))
    assert [d.result for d in done] == [0, 1, 2, 3, 4]  # in plan order
    assert [d.sent_s for d in done] == [0.5, 0.0, 2.0, 2.0, 3.25]


def test_concurrency_cap_and_turn_order_hold_requests_back() -> None:
    fake = FakeClock()
    release = {i: asyncio.Event() for i in range(4)}
    started: list[tuple[int, float]] = []

    async def send(request: BenchRequest) -> None:
        index = request.segments[0][0]
        started.append((index, fake.now - 100.0))
        await release[index].wait()

    async def scenario() -> list[Dispatched[None]]:
        # 3 is the next turn of 0; at most two in flight
        task = asyncio.create_task(arrivals.dispatch(_plan([0.0, 1.0, 2.0, 3.0], {3: 0}), send, clock=fake.clock(),
                                                     max_concurrency=2))
        for _ in range(20):
            await asyncio.sleep(0)
        assert started == [(0, 0.0), (1, 1.0)]  # 2 arrived at 2.0 but both places are taken
        release[1].set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert started[2] == (2, 3.0)  # it went when 1 finished (the clock had reached 3 by then)
        release[0].set()
        release[2].set()
        release[3].set()
        return await task

    done = asyncio.run(scenario())
    assert [index for index, _ in started] == [0, 1, 2, 3] and done[3].sent_s == 3.0


# ---- real runs against the bundled model -------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> str:
    thread = LoopThread()

    async def start() -> tuple[InProcessEngineClient, object, str]:
        engine = InProcessEngineClient(EngineConfig(device="cpu", max_model_len=1024, cpu_cache_bytes=64 << 20))
        await engine.start()
        runner = runner_for(build_app(engine, ServerSettings()), access_log=False)
        await runner.setup()
        from aiohttp import web
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return engine, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    engine, runner, url = thread.run(start())
    yield url
    thread.run(runner.cleanup())
    thread.run(engine.shutdown(0.0))
    thread.close()


def histograms(url: str) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of the server's TTFT and E2E histograms, whatever their prefix
    (hypic_ now, vllm: after the rename to vLLM's names)."""
    async def fetch() -> str:
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            return await response.text()

    found: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(asyncio.run(fetch())):
        kind = next((k for k in ("time_to_first_token_seconds", "e2e_request_latency_seconds") if family.name.endswith(k)), None)
        if kind:
            found[kind] = {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    return found


def run_bench(*options: str) -> int:
    return main(["bench", "serve", "--no-progress", *options])


def test_a_short_run_has_every_metric_and_agrees_with_the_servers_histograms(server, tmp_path) -> None:
    before = histograms(server)
    out = tmp_path / "run.json"
    assert run_bench("--url", server, "--documents", "8", "--doc-tokens", "48", "--docs-per-request", "3",
                     "--system-tokens", "16", "--question-tokens", "8", "--max-tokens", "6", "--num-requests", "6",
                     "--request-rate", "8,inf", "--cache-modes", "prefix,hypic", "--out", str(out)) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert {"date", "commit", "command", "server", "workload", "slo"} <= result.keys()
    assert result["command"].startswith(f"hypic bench serve --no-progress --url {server} --documents 8")
    assert [s["label"] for s in result["series"]] == ["prefix", "hypic"]
    samples = []
    for series in result["series"]:
        assert {"sustainable", "saturated_rps", "saturated_output_tokens_per_s"} <= series.keys()
        for point in series["points"]:
            assert point["errors"] == 0 and point["completed"] == 6
            for metric in ("ttft", "itl", "tpot", "e2e"):
                assert all(point[f"{metric}_{q}_s"] > 0 for q in ("mean", "p50", "p90", "p99"))
            assert point["achieved_rps"] > 0 and point["input_tokens_per_s"] > point["output_tokens_per_s"] > 0
            assert 0 < point["cached_token_fraction"] < 1 and point["goodput_rps"] <= point["achieved_rps"]
            samples += point["samples"]
    assert result["series"][1]["points"][0]["cached_token_fraction"] > result["series"][0]["points"][0]["cached_token_fraction"]
    after = histograms(server)
    for kind, values in (("time_to_first_token_seconds", [s["ttft_s"] for s in samples]),
                         ("e2e_request_latency_seconds", [s["e2e_s"] for s in samples])):
        served = {bound: after[kind][bound] - before[kind].get(bound, 0) for bound in after[kind]}
        assert served[math.inf] == len(values)
        for bound in served:
            # the server's clock starts after the client's and stops before it: never a slower bucket
            assert served[bound] >= sum(value <= bound for value in values)


def test_the_checked_in_trace_replays_in_order(server, tmp_path) -> None:
    out = tmp_path / "trace.json"
    assert run_bench("--url", server, "--trace", str(TRACE), "--no-plot", "--out", str(out), "--api-key", "k") == 0
    assert json.loads(out.read_text())["command"].endswith("--api-key '***'")
    point, = json.loads(out.read_text())["series"][0]["points"]
    samples = point["samples"]
    assert [s["arrival_s"] for s in samples] == [0.0, 0.25, 0.5, 1.0]
    assert [s["completion_tokens"] for s in samples] == [4, 3, 2, 5] and point["errors"] == 0
    assert all(later["sent_s"] >= earlier["sent_s"] for earlier, later in zip(samples, samples[1:]))
    assert samples[1]["prompt_tokens"] == 9 and point["request_rate"] == pytest.approx(3.0)


def test_the_same_tokens_give_the_same_answers_in_every_form(server, tokenizer) -> None:
    request = take(RagWorkload(tokenizer, SMALL_RAG), 1)[0]

    async def answers() -> list[tuple[int, str]]:
        replies = []
        async with aiohttp.ClientSession() as session:
            for backend, form in (("hypic", "ids"), ("hypic", "text"), ("openai", "ids")):
                path, body = client.request_body(Target(server, "", backend, form, cache_mode="none"), request)
                body = {key: value for key, value in body.items() if key not in ("model", "stream_options")}
                async with session.post(server + path, json={**body, "stream": False, "cache_mode": "none"}) as response:
                    reply = await response.json()
                replies.append((reply["usage"]["prompt_tokens"], reply["choices"][0]["text"]))
        return replies

    replies = asyncio.run(answers())
    assert replies[0][0] == len(request.token_ids) and len(set(replies)) == 1


def test_bad_token_id_segments_get_a_400_naming_the_problem(server) -> None:
    async def status(segments: list) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            async with session.post(server + "/v1/completions", json={"segments": segments, "max_tokens": 1}) as response:
                return response.status, (await response.json())["error"]["message"]

    code, message = asyncio.run(status([[1, 2], [99999]]))
    assert code == 400 and "99999" in message and "[0, 3072)" in message
    code, message = asyncio.run(status([[], []]))
    assert code == 400 and "empty" in message
    code, _ = asyncio.run(status(["text", [1, 2]]))
    assert code == 400


def test_cold_documents_are_new_and_counted(tokenizer) -> None:
    spec = RagSpec(**{**SMALL_RAG.__dict__, "cold_fraction": 0.25})
    workload = RagWorkload(tokenizer, spec)
    requests = take(workload, 80)
    seen: set[str] = set(workload.documents)
    for request in requests:
        new = [doc for doc in request.texts[1:-1] if doc not in seen]
        assert len(new) == request.cold_segments
        seen.update(new)
    assert 0.15 < sum(r.cold_segments for r in requests) / (80 * 3) < 0.35


def test_plot_draws_several_runs_together(tmp_path, capsys) -> None:
    def result(label: str, achieved: float) -> dict:
        points = [{**_point(1.0, 0.2, 1.0), "ttft_p99_s": 0.3}, {**_point(math.inf, 3.0, achieved), "ttft_p99_s": 4.0}]
        return {"slo": {"ttft_s": 1.0}, "series": [{"label": label, "points": points, **stats.saturation(points),
                                                      "sustainable": stats.sustainable_rate(points, stats.Slo())}]}
    paths = []
    for label, achieved in (("vllm", 2.0), ("hypic", 6.0)):
        paths.append(tmp_path / f"{label}.json")
        report.write_json(paths[-1], result(label, achieved))
    assert json.loads(paths[0].read_text())["series"][0]["points"][1]["request_rate"] == "inf"
    assert main(["bench", "plot", str(tmp_path / "both.png"), *map(str, paths)]) == 0
    assert (tmp_path / "both.png").stat().st_size > 10_000
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("vllm: sustainable 1 req/s (at_least)") and "saturated 6.00 req/s" in lines[1]


def test_a_chat_run_sends_each_turn_after_the_previous_one(server, tokenizer, tmp_path) -> None:
    out = tmp_path / "chat.json"
    assert run_bench("--url", server, "--workload", "chat", "--conversations", "2", "--turns", "3", "--system-tokens",
                     "8", "--user-tokens", "8", "--answer-tokens", "8", "--max-tokens", "3", "--warmup", "2",
                     "--num-requests", "6", "--no-plot", "--out", str(out)) == 0
    samples = json.loads(out.read_text())["series"][0]["points"][0]["samples"]
    stream = take(ChatWorkload(tokenizer, ChatSpec(2, 3, 8, 8, 8, 3)), 6, key="inf")  # the point's own stream
    assert [s["prompt_tokens"] for s in samples] == [len(r.token_ids) for r in stream]
    waits = [(s, samples[r.after]) for s, r in zip(samples, stream) if r.after is not None]
    assert waits and all(s["sent_s"] >= before["sent_s"] + before["e2e_s"] for s, before in waits)


def test_a_missing_bench_extra_is_named_before_any_request(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--no-plot"]) == 2  # nothing listens there
    error = capsys.readouterr().err
    assert "the progress bar needs tqdm" in error and "pip install 'hypic[bench]'" in error and "--no-progress" in error


# ---- results built by several runs (--merge) ---------------------------------------------------

SMALL_RUN = ("--documents", "8", "--doc-tokens", "48", "--docs-per-request", "3", "--system-tokens", "16",
             "--question-tokens", "8", "--max-tokens", "4", "--num-requests", "4")


@pytest.fixture(scope="module")
def merged_runs(server, tmp_path_factory) -> tuple[Path, list[dict], list[list[str]]]:
    """Three runs into one file: prefix at 8 and inf killed after its first point, hypic at both
    rates merged in, then prefix's inf point merged in (drawn with real matplotlib only there).
    The file after each run, and the labels of the series each PNG drew."""
    out, snapshots, drawn = tmp_path_factory.mktemp("merge") / "fig11.json", [], []
    summarize = stats.summarize
    with pytest.MonkeyPatch.context() as patch:
        calls = iter(range(2))
        patch.setattr(stats, "summarize", lambda *a: summarize(*a) if next(calls) == 0 else _killed())
        with pytest.raises(KeyboardInterrupt):
            run_bench("--url", server, *SMALL_RUN, "--cache-modes", "prefix", "--request-rate", "8,inf",
                      "--no-plot", "--out", str(out))
    snapshots.append(json.loads(out.read_text()))
    assert run_bench("--url", server, *SMALL_RUN, "--cache-modes", "hypic", "--request-rate", "8,inf", "--merge",
                     "--no-plot", "--out", str(out)) == 0
    snapshots.append(json.loads(out.read_text()))
    with pytest.MonkeyPatch.context() as patch:
        plot = report.plot
        patch.setattr(report, "plot", lambda path, series, *rest: (drawn.append([s["label"] for s in series]),
                                                                      plot(path, series, *rest)))
        assert run_bench("--url", server, *SMALL_RUN, "--cache-modes", "prefix", "--request-rate", "inf", "--merge",
                         "--out", str(out)) == 0
    snapshots.append(json.loads(out.read_text()))
    return out, snapshots, drawn


def _killed() -> None:
    raise KeyboardInterrupt("the device call's time limit")


def test_a_killed_run_leaves_the_points_it_finished(merged_runs) -> None:
    _, (partial, _, _), _ = merged_runs
    series, = partial["series"]
    point, = series["points"]
    assert series["label"] == "prefix" and point["request_rate"] == 8.0 and point["completed"] == 4
    assert point["run"]["command"] == partial["command"] and "--request-rate 8,inf" in partial["command"]
    assert series["saturated_rps"] == point["achieved_rps"]
    assert series["sustainable"] == stats.sustainable_rate(series["points"], stats.Slo(**partial["slo"]))


def test_merged_runs_keep_every_series_with_its_own_runs(merged_runs) -> None:
    out, (partial, second, final), drawn = merged_runs
    assert [s["label"] for s in second["series"]] == [s["label"] for s in final["series"]] == ["prefix", "hypic"]
    prefix, hypic = final["series"]
    assert prefix["points"][0] == partial["series"][0]["points"][0]  # kept as the killed run measured it
    assert hypic == second["series"][1]  # untouched by the third run
    assert [p["request_rate"] for p in prefix["points"]] == [8.0, "inf"] and prefix["points"][1]["completed"] == 4
    commands = [p["run"]["command"] for s in final["series"] for p in s["points"]]
    assert commands == [partial["command"], final["command"], second["command"], second["command"]]
    assert len(set(commands)) == 3 and final["command"].endswith(f"--merge --out {out}")
    points = report.read_result(out)["series"][0]["points"]
    assert prefix["sustainable"] == stats.sustainable_rate(points, stats.Slo(**final["slo"]))
    assert prefix["saturated_rps"] == max(p["achieved_rps"] for p in points)
    assert drawn and all(labels == ["prefix", "hypic"] for labels in drawn)
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_a_rate_sends_its_own_stream_in_every_series_and_run(merged_runs, tokenizer) -> None:
    _, (_, _, final), _ = merged_runs
    workload = RagWorkload(tokenizer, RagSpec(documents=8, doc_tokens=48, docs_per_request=3, system_tokens=16,
                                              question_tokens=8, max_tokens=4))
    for series in final["series"]:  # prefix's points measured by two runs, hypic's by a third
        for point, key in zip(series["points"], ("8", "inf")):
            sent = [len(request.token_ids) for request in take(workload, 4, key=key)]
            assert [sample["prompt_tokens"] for sample in point["samples"]] == sent
    assert take(workload, 4, key="8") != take(workload, 4, key="inf")


def test_a_merge_into_other_settings_is_refused_before_anything_is_sent(merged_runs, server, capsys) -> None:
    out = merged_runs[0]
    before = out.read_bytes()
    capsys.readouterr()
    # nothing listens at port 9: a request would fail with a connection error, not this refusal
    assert run_bench("--url", "http://127.0.0.1:9", *SMALL_RUN, "--max-tokens", "5", "--slo-ttft", "2",
                     "--cache-modes", "none", "--merge", "--no-plot", "--out", str(out)) == 2
    error = capsys.readouterr().err
    assert "workload.max_tokens: 4 in the file, 5 now" in error and "slo.ttft_s: 1.0 in the file, 2.0 now" in error
    assert "--out" in error and "workload.documents" not in error
    assert run_bench("--url", server, *SMALL_RUN, "--model", "another", "--cache-modes", "none", "--merge",
                     "--no-plot", "--out", str(out)) == 2
    assert "server.model: 'default_model' in the file, 'another' now" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_the_fig11_parts_of_one_file_differ_only_in_mode_and_rates(tmp_path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_fig11

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    parsed = {part: vars(parser.parse_args(bench_fig11.bench_argv([part], None, tmp_path / "r.json", True)[2:]))
              for part in bench_fig11.PARTS}
    varying = {"cache_modes", "request_rate"}
    settings = {part: {k: v for k, v in args.items() if k not in varying} for part, args in parsed.items()}
    assert settings["hypic"] == settings["none"] == settings["prefix"]
    assert {k for k in settings["hypic"] if settings["hypic"][k] != settings["pool5x"][k]} == {"server_command"}
    assert [parsed[part]["cache_modes"] for part in ("hypic", "none", "prefix")] == [["hypic"], ["none"], ["prefix"]]
    assert all(parsed[part]["request_rate"][-1] == math.inf and parsed[part]["merge"] for part in parsed)
    both = vars(parser.parse_args(bench_fig11.bench_argv(["none", "prefix"], "2,inf", tmp_path / "r.json", True)[2:]))
    assert both["cache_modes"] == ["none", "prefix"] and both["request_rate"] == [2.0, math.inf]
    with pytest.raises(SystemExit, match="run them apart"):
        bench_fig11.bench_argv(["hypic", "pool5x"], None, tmp_path / "r.json", True)
