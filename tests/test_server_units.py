"""Server pieces that need no engine: body parsing, error mapping, formats, metrics, options."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import re
import threading
from pathlib import Path
from dataclasses import dataclass

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hypic.cache.prefix_cache import PrefixCacheStats
from hypic.cache.disk_tier import DiskStats
from hypic.cache.segment_store import SegmentStoreStats
from hypic.cache.tier_stats import TierStats
from hypic.config import EngineConfig
from hypic.engine.llm_engine import EngineStats
from hypic.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError
from hypic.outputs import CompletionDelta, RequestMetrics, RequestOutput, TokenLogprob
from hypic.serve.args import add_serve_arguments, engine_config, server_settings
from hypic.serve.completions import completion_prompts
from hypic.serve.http_errors import ApiError, from_body_error, from_engine_error
from hypic.serve.limits import RequestLimits
from hypic.serve import memory
from hypic.serve.logprobs import chat_logprobs, completion_logprobs
from hypic.serve.metrics import ServerMetrics
from hypic.serve.protocol import ChatRequest, CompletionRequest, unsupported_fields
from hypic.serve.sampling import sampling_params


def _decode(body: dict, body_type: type) -> object:
    return msgspec.json.decode(json.dumps(body).encode(), type=body_type)


def _body_error(body: bytes, body_type: type) -> ApiError:
    with pytest.raises(msgspec.MsgspecError) as caught:
        msgspec.json.decode(body, type=body_type)
    return from_body_error(caught.value)


def test_completion_prompt_shapes_follow_openai() -> None:
    shapes = {
        "text": ("abc", ["abc"]),
        "batch of texts": (["a", "b"], ["a", "b"]),
        "token ids": ([1, 2, 3], [[1, 2, 3]]),
        "batch of token ids": ([[1], [2, 3]], [[1], [2, 3]]),
    }
    for prompt, expected in shapes.values():
        assert completion_prompts(_decode({"prompt": prompt}, CompletionRequest)) == expected
    assert completion_prompts(_decode({"segments": ["sys", "doc", "q"]}, CompletionRequest)) == [["sys", "doc", "q"]]


@pytest.mark.parametrize("body", [{}, {"prompt": []}, {"prompt": ["a", 1]}, {"prompt": "a", "segments": ["b"]}])
def test_bad_completion_prompts_name_the_field(body: dict) -> None:
    with pytest.raises(ApiError) as caught:
        completion_prompts(_decode(body, CompletionRequest))
    assert caught.value.status == 400 and caught.value.param in ("prompt", "segments")


def test_schema_errors_name_the_field() -> None:
    cases = {
        b'{"prompt": "a", "n": "2"}': "n",
        b'{"prompt": "a", "n": 0}': "n",
        b'{"prompt": "a", "frobnicate": 1}': "frobnicate",
        b'{"messages": [{"role": "user", "content": "x", "extra": 1}]}': "messages[0].extra",
        b'{"messages": [{"role": "robot", "content": "x"}]}': "messages[0].role",
        b'{"model": "m"}': "messages",
    }
    for body, field in cases.items():
        body_type = ChatRequest if b"messages" in body or b'"model"' in body else CompletionRequest
        error = _body_error(body, body_type)
        assert (error.status, error.param) == (400, field), body


def test_malformed_json_is_a_400() -> None:
    error = _body_error(b'{"prompt": ', CompletionRequest)
    assert error.status == 400 and "not valid JSON" in error.message


def test_large_bodies_are_decoded_and_trimmed_on_one_thread_of_their_own(monkeypatch) -> None:
    """Not the event loop's nor its executor's threads: glibc keeps a heap per allocating thread,
    and decodes spread over several left resident memory to the scheduling (hypic/serve/memory.py)."""
    trimmed = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: lambda pad: trimmed.append(threading.get_ident()))

    async def main() -> tuple[list[int], int]:
        bodies = memory.LargeBodies()
        try:
            decoded = await asyncio.gather(*(bodies.decode(threading.get_ident) for _ in range(4)))
            await bodies.give_back_memory()
            return decoded, await asyncio.to_thread(threading.get_ident)
        finally:
            bodies.close()

    decoded, executor = asyncio.run(main())
    assert len(set(decoded + trimmed)) == 1 and not {threading.get_ident(), executor} & set(decoded)
    assert gc.isenabled()


def test_unimplemented_fields_are_rejected_but_null_is_accepted() -> None:
    names, messages = ("functions", "function_call"), [{"role": "user", "content": "hi"}]
    assert unsupported_fields(_decode({"messages": messages, "functions": None}, ChatRequest), names) == []
    assert unsupported_fields(_decode({"messages": messages, "function_call": "none"}, ChatRequest), names) == []
    body = _decode({"messages": messages, "functions": [{"name": "f"}]}, ChatRequest)
    assert unsupported_fields(body, names) == ["functions"]


def test_engine_errors_map_to_statuses() -> None:
    too_long = from_engine_error(PromptTooLongError(5000, 4096, 16), {})
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")
    assert "5000" in too_long.message and "4096" in too_long.message
    overloaded = from_engine_error(EngineOverloadedError(10, 10, retry_after=2.5), {})
    assert overloaded.status == 503 and overloaded.headers["Retry-After"] == "3"
    invalid = from_engine_error(InvalidRequestError("logprobs must be in [0, 20], got 30"), {"logprobs": "top_logprobs"})
    assert (invalid.status, invalid.param) == (400, "top_logprobs")
    body = json.loads(invalid.response().body)
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_sampling_params_reject_what_json_allows_but_sampling_cannot_take() -> None:
    for body, field in (({"temperature": 1e308 * 10}, "temperature"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"seed": 1 << 70}, "seed")):
        request = CompletionRequest(prompt="a", **body)
        with pytest.raises(ApiError) as caught:
            sampling_params(request, max_tokens=1, logprobs=None)
        assert caught.value.param == field
    params = sampling_params(CompletionRequest(prompt="a", logit_bias={"7": -5.0}, stop="x"), max_tokens=3, logprobs=2)
    assert (params.logit_bias, params.stop, params.max_tokens, params.logprobs) == ({7: -5.0}, ("x",), 3, 2)


def test_logprob_formats() -> None:
    items = (TokenLogprob(5, "ab", -0.1, ((5, "ab", -0.1), (6, "c", -2.0))), TokenLogprob(6, "c", float("-inf"), ()))
    legacy = completion_logprobs(items, text_offset=3)
    assert legacy.tokens == ["ab", "c"] and legacy.text_offset == [3, 5]
    assert legacy.top_logprobs == [{"ab": -0.1, "c": -2.0}, {"c": -9999.0}]  # the chosen token is always listed
    chat = chat_logprobs(items)
    assert [entry.token for entry in chat.content] == ["ab", "c"]
    assert chat.content[0].bytes == list(b"ab") and [t.token for t in chat.content[0].top_logprobs] == ["ab", "c"]


@dataclass(frozen=True)
class _PrefixStats:
    checkpoints: int = 2
    hits: int = 5
    misses: int = 3


@dataclass(frozen=True)
class _Stats:
    running: int = 1
    waiting: int = 2
    kv_blocks_total: int = 100
    kv_blocks_free: int = 75
    block_size: int = 16
    state_slots_total: int = 8
    state_slots_free: int = 6
    prefix_cache: _PrefixStats = _PrefixStats()
    segment_pool: _PrefixStats = _PrefixStats()
    segment_host: None = None  # no lower tiers: no series
    segment_disk: None = None
    preemptions: int = 7
    steps_out_of_memory: int = 3


def _metric_families(metrics: ServerMetrics) -> dict[str, tuple[str, dict[tuple, float]]]:
    """name -> (type, {(sample name, labels without model_name): value}); every series has model_name="m"."""
    families = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        assert all(s.labels.get("model_name") == "m" for s in family.samples), family.name
        families[family.name] = (family.type, {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for s in family.samples})
    return families


def _token(delta_index: int, reason: str | None = None) -> CompletionDelta:
    return CompletionDelta(delta_index, "x", (5,), None, reason)


def test_metrics_carry_vllm_names_types_and_the_model_name_label() -> None:
    metrics = ServerMetrics(_Stats, "cpu", "m")
    first = RequestMetrics(0.0, 0.01, 0.2, 30, 16, {"prefix": 16}, 1, token_steps=1, decode_time=0.0)
    metrics.observe(RequestOutput("r", (_token(0),), False, first))
    steps = [dataclasses.replace(first, generated_tokens=n + 1, token_steps=n + 1, inter_token_latency=0.02 * n,
                                 decode_time=0.02 * n * (n + 1) / 2) for n in (1, 2, 3)]
    for step in steps[:-1]:
        metrics.observe(RequestOutput("r", (_token(0),), False, step))
    metrics.observe(RequestOutput("r", (_token(0, "length"),), True, steps[-1]))
    metrics.http_requests.labels("/v1/completions", "200").inc()
    f = _metric_families(metrics)
    assert f["vllm:prompt_tokens"] == ("counter", {("vllm:prompt_tokens_total", ()): 30})
    assert f["vllm:generation_tokens"][1][("vllm:generation_tokens_total", ())] == 4
    assert f["vllm:prefix_cache_queries"][1][("vllm:prefix_cache_queries_total", ())] == 30
    assert f["vllm:prefix_cache_hits"][1][("vllm:prefix_cache_hits_total", ())] == 16
    assert f["hypic_cached_prompt_tokens"][1][("hypic_cached_prompt_tokens_total", (("kind", "prefix"),))] == 16
    assert f["vllm:request_success"][1][("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    itl = f["vllm:inter_token_latency_seconds"]
    assert itl[0] == "histogram" and itl[1][("vllm:inter_token_latency_seconds_count", ())] == 3
    assert itl[1][("vllm:inter_token_latency_seconds_sum", ())] == pytest.approx(0.02 + 0.04 + 0.06)
    tpot = f["vllm:request_time_per_output_token_seconds"][1]  # (0.02 + 0.04 + 0.06) s over 3 steps
    assert tpot[("vllm:request_time_per_output_token_seconds_sum", ())] == pytest.approx(0.04)
    assert f["vllm:request_prefill_time_seconds"][1][("vllm:request_prefill_time_seconds_sum", ())] == pytest.approx(0.19)
    assert f["vllm:request_decode_time_seconds"][1][("vllm:request_decode_time_seconds_sum", ())] == pytest.approx(0.12)
    assert f["vllm:time_to_first_token_seconds"][1][("vllm:time_to_first_token_seconds_count", ())] == 1
    assert f["vllm:request_prompt_tokens"][1][("vllm:request_prompt_tokens_bucket", (("le", "50.0"),))] == 1
    assert f["hypic_http_requests"][1][("hypic_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1


def test_engine_stats_become_vllm_gauges_and_cache_counters() -> None:
    f = _metric_families(ServerMetrics(_Stats, "cpu", "m"))
    assert f["vllm:kv_cache_usage_perc"] == ("gauge", {("vllm:kv_cache_usage_perc", ()): pytest.approx(0.25)})
    assert f["vllm:num_requests_waiting"] == ("gauge", {("vllm:num_requests_waiting", ()): 2})
    assert f["vllm:num_preemptions"] == ("counter", {("vllm:num_preemptions_total", ()): 7})
    assert f["hypic_steps_out_of_memory"] == ("counter", {("hypic_steps_out_of_memory_total", ()): 3})
    for cache in ("prefix_cache", "segment_pool"):
        assert f[f"hypic_{cache}_hits"] == ("counter", {(f"hypic_{cache}_hits_total", ()): 5})
        assert f[f"hypic_{cache}_misses"] == ("counter", {(f"hypic_{cache}_misses_total", ()): 3})
        assert f[f"hypic_{cache}_checkpoints"] == ("gauge", {(f"hypic_{cache}_checkpoints", ()): 2})
    assert not any(name.startswith("hypic_gpu") for name in f)  # no CUDA, no NVML


def test_docs_list_every_series_with_its_type() -> None:
    """docs/metrics.md's table against what a server renders (real cache stats, every field zero)."""
    zero = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    stats = EngineStats(**{**zero, "prefix_cache": PrefixCacheStats(*[0] * 7), "segment_pool": SegmentStoreStats(*[0] * 7),
                           "segment_host": TierStats(*[0] * 9), "segment_disk": DiskStats(*[0] * 11)})
    rendered = {name: kind for name, (kind, _) in _metric_families(ServerMetrics(lambda: stats, "cpu", "m")).items()
                if not name.endswith("_created")}
    table = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \| ([^|]+) \|", table.read_text(encoding="utf-8"), re.MULTILINE)
    assert {name: kind for name, kind, _ in rows} == rendered
    assert all("model_name" in labels for _, _, labels in rows)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_options_map_into_engine_config_and_settings() -> None:
    args = _parse("--cpu-cache-bytes", "64MiB", "--cache-mode", "none", "--max-waiting", "7", "--api-key", "k",
                  "--served-model-name", "tiny", "--shutdown-grace", "2", "--seam-width", "4",
                  "--segment-pool-bytes", "1G", "--segment-state-dtype", "bfloat16", "--segment-host-bytes", "2G",
                  "--segment-disk-dir", "/tmp/tuples", "--segment-disk-bytes", "3G",
                  "--long-prefill-token-threshold", "0")
    config, settings = engine_config(args), server_settings(args)
    assert config.long_prefill_token_threshold == 0
    assert (config.cpu_cache_bytes, config.cache_mode, config.max_waiting) == (64 << 20, "none", 7)
    assert (config.seam_width, config.segment_pool_bytes, config.segment_state_dtype) == (4, 1 << 30, "bfloat16")
    assert (config.segment_host_bytes, config.segment_disk_dir, config.segment_disk_bytes) == (
        2 << 30, "/tmp/tuples", 3 << 30)
    assert (settings.api_key, settings.served_model_name, settings.shutdown_grace_s) == ("k", "tiny", 2.0)
    assert engine_config(_parse()) == EngineConfig()  # no options: the engine's own defaults
    assert server_settings(_parse()).limits == RequestLimits()
    limited = server_settings(_parse("--max-body-bytes", "4MiB", "--max-json-depth", "8", "--max-segments", "9",
                                     "--max-sequences-per-request", "5", "--header-timeout", "1.5",
                                     "--body-timeout", "3", "--max-connections", "6")).limits
    assert limited == RequestLimits(4 << 20, 8, 5, 9, 1.5, 3.0, 6)
    for bad in (("--device", "tpu"), ("--header-timeout", "0"), ("--max-connections", "-1"),
                ("--long-prefill-token-threshold", "-1")):
        with pytest.raises(SystemExit):
            _parse(*bad)
    with pytest.raises(InvalidRequestError, match="segment_state_dtype"):
        EngineConfig(segment_state_dtype="float16")


def test_console_script_has_the_serve_command(capsys) -> None:
    from hypic.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", "--help"])
    assert caught.value.code == 0 and "--served-model-name" in capsys.readouterr().out
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--cpu-cache-bytes", "lots"])
    assert caught.value.code == 2 and "--cpu-cache-bytes" in capsys.readouterr().err
