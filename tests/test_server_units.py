"""Server pieces that need no engine: body parsing, error mapping, formats, metrics, options."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hypic.config import EngineConfig
from hypic.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError
from hypic.outputs import RequestMetrics, RequestOutput, TokenLogprob
from hypic.serve.args import add_serve_arguments, engine_config, server_settings
from hypic.serve.completions import completion_prompts
from hypic.serve.http_errors import ApiError, from_body_error, from_engine_error
from hypic.serve.limits import RequestLimits
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


def test_unimplemented_fields_are_rejected_but_null_is_accepted() -> None:
    names, messages = ("tools", "tool_choice", "response_format"), [{"role": "user", "content": "hi"}]
    assert unsupported_fields(_decode({"messages": messages, "tools": None}, ChatRequest), names) == []
    assert unsupported_fields(_decode({"messages": messages, "tool_choice": "none"}, ChatRequest), names) == []
    body = _decode({"messages": messages, "response_format": {"type": "json_object"}}, ChatRequest)
    assert unsupported_fields(body, names) == ["response_format"]


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


def test_metrics_render_counters_histograms_and_engine_gauges() -> None:
    metrics = ServerMetrics(_Stats, "cpu")
    output = RequestOutput("r", (), True, RequestMetrics(0.0, 0.01, 0.2, 30, 16, {"prefix": 16}, 4))
    metrics.observe_finished(output)
    metrics.http_requests.labels("/v1/completions", "200").inc()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples[("hypic_prompt_tokens_total", ())] == 30
    assert samples[("hypic_generation_tokens_total", ())] == 4
    assert samples[("hypic_cached_prompt_tokens_total", (("kind", "prefix"),))] == 16
    assert samples[("hypic_time_to_first_token_seconds_count", ())] == 1
    assert samples[("hypic_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert samples[("hypic_kv_cache_usage_ratio", ())] == pytest.approx(0.25)
    assert samples[("hypic_requests_waiting", ())] == 2 and samples[("hypic_prefix_cache_hits", ())] == 5
    assert samples[("hypic_segment_pool_hits", ())] == 5
    assert not any(name.startswith("hypic_gpu") for name, _ in samples)  # no CUDA, no NVML


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_options_map_into_engine_config_and_settings() -> None:
    args = _parse("--cpu-cache-bytes", "64MiB", "--cache-mode", "none", "--max-waiting", "7", "--api-key", "k",
                  "--served-model-name", "tiny", "--shutdown-grace", "2", "--seam-width", "4",
                  "--segment-pool-bytes", "1G", "--segment-state-dtype", "bfloat16")
    config, settings = engine_config(args), server_settings(args)
    assert (config.cpu_cache_bytes, config.cache_mode, config.max_waiting) == (64 << 20, "none", 7)
    assert (config.seam_width, config.segment_pool_bytes, config.segment_state_dtype) == (4, 1 << 30, "bfloat16")
    assert (settings.api_key, settings.served_model_name, settings.shutdown_grace_s) == ("k", "tiny", 2.0)
    assert engine_config(_parse()) == EngineConfig()  # no options: the engine's own defaults
    assert server_settings(_parse()).limits == RequestLimits()
    limited = server_settings(_parse("--max-body-bytes", "4MiB", "--max-json-depth", "8", "--max-segments", "9",
                                     "--max-sequences-per-request", "5", "--header-timeout", "1.5",
                                     "--body-timeout", "3", "--max-connections", "6")).limits
    assert limited == RequestLimits(4 << 20, 8, 5, 9, 1.5, 3.0, 6)
    for bad in (("--device", "tpu"), ("--header-timeout", "0"), ("--max-connections", "-1")):
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
