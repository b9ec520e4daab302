"""SamplingParams and EngineConfig check types as well as ranges, and name every bad field at once."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hypic import EngineConfig, SamplingParams
from hypic.config import DTYPES
from hypic.engine.setup import resolve_dtype
from hypic.errors import FieldProblem, InvalidFieldsError, InvalidRequestError


def _problems(cls: type, **fields: object) -> dict[str, FieldProblem]:
    with pytest.raises(InvalidFieldsError) as caught:
        cls(**fields)
    assert caught.value.owner == cls.__name__ and isinstance(caught.value, InvalidRequestError)
    return {problem.field: problem for problem in caught.value.problems}


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "0.5"), ("temperature", None), ("temperature", -0.1), ("max_tokens", 1.5), ("max_tokens", -1),
    ("n", True), ("n", 2.0), ("n", 0), ("top_k", False), ("top_k", -2), ("top_p", 0), ("top_p", "1"),
    ("min_p", 1.5), ("seed", 1.0), ("seed", 2**64), ("stop", 5), ("stop", ["a", ""]), ("stop", [b"a"]),
    ("stop_token_ids", [1.0]), ("stop_token_ids", [-1]), ("stop_token_ids", 3), ("ignore_eos", 1),
    ("presence_penalty", 2.5), ("frequency_penalty", "0"), ("repetition_penalty", 0), ("logit_bias", {"x": 1}),
    ("logit_bias", {3: "1"}), ("logit_bias", {3: 101}), ("logit_bias", {-1: 1}), ("logit_bias", [(3, 1)]),
    ("logprobs", 21), ("logprobs", True), ("skip_special_tokens", "no"),
])
def test_each_bad_sampling_field_is_named_with_its_value(field: str, value: object) -> None:
    problems = _problems(SamplingParams, **{field: value})
    listed = field in ("stop", "stop_token_ids") and isinstance(value, list)
    given = tuple(value) if listed else value  # lists of stops arrive as tuples
    assert list(problems) == [field] and problems[field].value == given
    assert str(problems[field]).startswith(f"{field} must be ") and f"got {problems[field].value!r}" in str(problems[field])


def test_every_problem_is_reported_at_once_in_field_order() -> None:
    with pytest.raises(InvalidFieldsError) as caught:
        SamplingParams(temperature="0.5", max_tokens=1.5, top_p=2.0, logprobs=-1)
    assert [p.field for p in caught.value.problems] == ["max_tokens", "temperature", "top_p", "logprobs"]
    message = str(caught.value)
    assert message.startswith("max_tokens must be an integer") and "got '0.5'" in message and "got 1.5" in message
    assert message.count(" must be ") == 4 and message.endswith("(SamplingParams)")


def test_good_sampling_values_are_normalised() -> None:
    params = SamplingParams(n=2, max_tokens=None, temperature=1, top_k=-1, seed=-5, stop="END",
                            stop_token_ids=[7, 9], logit_bias={"3": 100, 5: -2.5}, logprobs=0)
    assert (params.stop, params.stop_token_ids, params.logit_bias) == (("END",), (7, 9), {3: 100.0, 5: -2.5})
    assert all(type(bias) is float for bias in params.logit_bias.values())
    assert SamplingParams(stop=None, logit_bias=None) == SamplingParams()


@pytest.mark.parametrize(("field", "value"), [
    ("device", "gpu"), ("device", "cuda:x"), ("device", 0), ("dtype", "fp8"), ("model", 3),
    ("max_model_len", 0), ("max_model_len", 1.5), ("gpu_memory_utilization", 0), ("gpu_memory_utilization", "0.9"),
    ("cpu_cache_bytes", 1.5e9), ("block_size", 0), ("block_size", True), ("max_num_seqs", -1),
    ("max_num_batched_tokens", "8192"), ("long_prefill_token_threshold", -1),
    ("long_prefill_token_threshold", 64.0), ("max_waiting", 0), ("cache_mode", "exact"), ("cache_mode", None),
    ("seam_width", -1), ("segment_pool_bytes", -1), ("segment_state_dtype", "float16"), ("max_segments", 0),
    ("prefix_cache_fraction", 1.0), ("segment_separator", ""), ("enforce_eager", "yes"), ("seed", 0.5),
    ("state_dict", [1]),
])
def test_each_bad_engine_field_is_named_with_its_value(field: str, value: object) -> None:
    problems = _problems(EngineConfig, **{field: value})
    assert list(problems) == [field] and problems[field].value == value


def test_engine_config_reports_device_dtype_and_sizes_together() -> None:
    problems = _problems(EngineConfig, device="gpu", dtype="half", block_size=0, max_waiting=True)
    assert list(problems) == ["device", "dtype", "block_size", "max_waiting"]
    assert "cuda:N" in problems["device"].allowed and "bfloat16" in problems["dtype"].allowed


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_good_engine_values_pass(device: str) -> None:
    config = EngineConfig(device=device, dtype="bf16", max_model_len=64, gpu_memory_utilization=1,
                          cache_mode="naive", segment_pool_bytes=0, prefix_cache_fraction=0)
    assert dataclasses.replace(config, seed=3).device == device


def test_every_accepted_dtype_name_resolves() -> None:
    resolved = {resolve_dtype(EngineConfig(dtype=name).dtype, torch.device("cpu")) for name in DTYPES}
    assert resolved == {torch.bfloat16, torch.float16, torch.float32}


def test_a_path_names_the_model_directory(tmp_path) -> None:
    assert EngineConfig(model=tmp_path).model == str(tmp_path)
