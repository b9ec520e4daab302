"""The agent API against a real server (the bundled model, a Hermes-style test template): structured
output validated by `jsonschema`, required tool calls, tool turns through the template, reasoning,
and LangChain's bind_tools / with_structured_output end to end. One server for the module."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")  # test extras; absent on the GPU image
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests" / "assets" / "hermes_tools.jinja"
NAME = "tiny"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WORD = {"type": "string", "maxLength": 10}
SCHEMAS = [
    {"type": "object", "properties": {"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "maxItems": 3}, "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["owner", "pets"],
     "properties": {"owner": {"type": "object", "properties": {"first": WORD, "last": WORD},
                              "required": ["first"], "additionalProperties": False},
                    "pets": {"type": "array", "items": WORD, "maxItems": 2}}},
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": WORD, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    command = [sys.executable, "-m", "hypic.serve", "--device", "cpu", "--port", "0", "--max-model-len", "1024",
               "--cpu-cache-bytes", "64MiB", "--served-model-name", NAME, "--log-level", "warning",
               "--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    match = re.search(r"at (http://\S+) on", process.stdout.readline())
    assert match, "the server did not start"
    yield match.group(1)
    process.kill()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def _check_json(texts_and_reasons: list[tuple[str, str]], schema: dict) -> None:
    """At least 95 % end with stop, and every one that does is valid."""
    stopped = [text for text, reason in texts_and_reasons if reason == "stop"]
    assert len(stopped) >= 0.95 * len(texts_and_reasons), texts_and_reasons
    for text in stopped:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_replies_validate_whole_and_streamed(client, schema) -> None:
    reply = client.chat.completions.create(model=NAME, messages=ASK, response_format=_json_format(schema),
                                           n=2, max_tokens=120, seed=7)
    results = [(choice.message.content, choice.finish_reason) for choice in reply.choices]
    stream = client.chat.completions.create(model=NAME, messages=ASK, response_format=_json_format(schema),
                                            n=2, max_tokens=120, stream=True)
    texts, reasons = ["", ""], ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    _check_json(results + list(zip(texts, reasons)), schema)


LEAVES = st.sampled_from([WORD, {"type": "boolean"}, {"enum": ["a", "b", "c"]}, {"type": "null"},
                          {"type": "integer", "minimum": -5, "maximum": 500}])


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": sorted(properties)[:1],
            "additionalProperties": False}


BOUNDED = st.recursive(LEAVES, lambda inner: st.one_of(
    st.builds(lambda items, k: {"type": "array", "items": items, "maxItems": k}, inner, st.integers(0, 3)),
    st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, min_size=1, max_size=3).map(_object),
), max_leaves=5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=BOUNDED, seed=st.integers(0, 1000))
def test_generated_bounded_schemas_hold_on_completions(client, schema, seed) -> None:
    reply = client.completions.create(model=NAME, prompt="JSON:", max_tokens=150, seed=seed,
                                      extra_body={"guided_json": schema})
    _check_json([(reply.choices[0].text, reply.choices[0].finish_reason)], schema)


def test_regex_choice_and_logprobs_are_constrained(client) -> None:
    reply = client.completions.create(model=NAME, prompt="Code:", max_tokens=20, logprobs=2,
                                      extra_body={"structured_outputs": {"regex": "[A-C]{2}-[0-9]{3}"}})
    choice = reply.choices[0]
    assert re.fullmatch("[A-C]{2}-[0-9]{3}", choice.text) and choice.finish_reason == "stop"
    assert all(lp > float("-inf") for lp in choice.logprobs.token_logprobs)
    picked = client.chat.completions.create(model=NAME, messages=ASK, extra_body={"guided_choice": ["yes", "no"]})
    assert picked.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(("field", "value", "param"), [
    ("response_format", _json_format({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "response_format"),
    ("extra_body", {"guided_regex": "[a-"}, "guided_regex"),
    ("tools", [WEATHER, WEATHER], "tools"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters"),
    ("tool_choice", {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
])
def test_bad_constraints_and_tools_are_400(client, field, value, param) -> None:
    extra = {"tools": TOOLS} if field == "tool_choice" else {}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=NAME, messages=ASK, max_tokens=5, **extra, **{field: value})
    assert raised.value.body["param"] == param


def _check_call(call, tools: list[dict]) -> None:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_are_valid_and_stream_the_same(client, choice) -> None:
    args = dict(model=NAME, messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS,
                tool_choice=choice, temperature=0.0, max_tokens=150)
    message = client.chat.completions.create(**args)
    assert message.choices[0].finish_reason == "tool_calls"
    calls = message.choices[0].message.tool_calls
    assert calls and all(_check_call(call, TOOLS) is None for call in calls)
    if isinstance(choice, dict):
        assert [call.function.name for call in calls] == ["add"]
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = streamed.setdefault(delta.index, [delta.function.name, ""])
            entry[1] += delta.function.arguments or ""
    assert [tuple(v) for v in streamed.values()] == [(c.function.name, c.function.arguments) for c in calls]


def test_a_tool_turn_round_trip_renders_through_the_template(client) -> None:
    from hypic.engine.setup import BUNDLED_MODEL
    from hypic.engine.text.tokenizer import Tokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    history = [{"role": "user", "content": "What is 2 + 3?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    reply = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=1)
    tokenizer = Tokenizer.from_dir(BUNDLED_MODEL)
    tokenizer.use_chat_template(TEMPLATE.read_text())
    as_template = [history[0], {**history[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                   history[2]]
    text = tokenizer.apply_chat_template(as_template, tools=TOOLS)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert reply.usage.prompt_tokens == len(tokenizer.encode(text))


def test_thinking_prompt_puts_the_reply_in_reasoning_and_the_json_after_it(client) -> None:
    schema = SCHEMAS[0]
    # ignore_eos: only the grammar can end the reply, so "stop" means the reasoning closed and JSON followed
    args = dict(model=NAME, messages=ASK, max_tokens=40, seed=3, response_format=_json_format(schema),
                extra_body={"chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True})
    reply = client.chat.completions.create(**args).choices[0]
    assert reply.message.reasoning_content  # the tiny model thinks until its budget runs out
    if reply.finish_reason == "stop":
        jsonschema.validate(json.loads(reply.message.content), schema)
    streamed = [c.choices[0].delta for c in client.chat.completions.create(**args, stream=True) if c.choices]
    assert "".join(d.reasoning_content or "" for d in streamed if hasattr(d, "reasoning_content"))


def test_langchain_bind_tools_and_structured_output(server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    model = langchain_openai.ChatOpenAI(model=NAME, base_url=server + "/v1", api_key="unused", temperature=0,
                                        max_tokens=150, max_retries=0)
    called = model.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [call["name"] for call in called.tool_calls] == ["get_weather"]
    jsonschema.validate(called.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    person = model.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person)


def _described(name: str) -> dict:
    description = f"{name}: " + " ".join(f"step {i} of what {name} does with its inputs;" for i in range(4))
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": {"q": WORD}}}}


def test_tool_definitions_as_segments_are_reused_in_any_subset_and_order(client) -> None:
    from hypic.engine.setup import BUNDLED_MODEL
    from hypic.engine.text.tokenizer import Tokenizer
    a, b, c, d = (_described(name) for name in ("alpha", "beta", "gamma", "delta"))
    extra = {"tool_segments": True, "cache_salt": "tool-segments-test"}

    def cached(tools: list[dict]) -> int:
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=tools, max_tokens=1, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached([a, b, c]) == 0
    tokenizer, seam = Tokenizer.from_dir(BUNDLED_MODEL), 8  # the engine's default seam_width
    interiors = sum(len(tokenizer.encode(json.dumps(tool))) - 2 * seam for tool in (c, a))
    assert cached([c, d, a]) >= interiors  # gamma and alpha come from the pool, at new positions


def _post(server: str, path: str, body: dict) -> dict:
    import urllib.request
    request = urllib.request.Request(server + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_detokenize_inverts_tokenize_and_version_matches_the_cli(server) -> None:
    import urllib.request
    text = "Hello <|im_end|> world, 42!"
    tokens = _post(server, "/tokenize", {"prompt": text})["tokens"]
    assert _post(server, "/detokenize", {"tokens": tokens}) == {"prompt": text}
    with urllib.request.urlopen(server + "/version", timeout=30) as response:
        served = json.loads(response.read())["version"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    printed = subprocess.run([sys.executable, "-c", "import sys; from hypic.cli import main; sys.exit(main())", "--version"], capture_output=True, text=True,
                             env=env, check=True).stdout
    assert printed.strip() == f"hypic {served}"


def test_a_request_without_max_tokens_gets_the_generation_config_default(client) -> None:
    from hypic.engine.setup import BUNDLED_MODEL
    default = json.loads((BUNDLED_MODEL / "generation_config.json").read_text())["max_new_tokens"]
    for max_tokens in (None, openai.NOT_GIVEN):
        reply = client.completions.create(model=NAME, prompt="Once", max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == default
