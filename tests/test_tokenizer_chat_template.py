"""Chat templates render exactly as in transformers; bad conversations raise typed errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hypic.engine.text.tokenizer import Tokenizer
from hypic.errors import InvalidRequestError, UnsupportedModelError
from tokenizer_util import write_byte_level

# Uses what Hub templates use: namespace, loop controls, tojson (non-ASCII, indent), strftime_now,
# raise_exception, {% generation %}, whitespace control, tools, extra kwargs (enable_thinking),
# content None (dropped), reasoning under another name (aliased to reasoning_content).
RICH = """
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if tools %}
<|im_start|>system
Tools: {{ tools | tojson(indent=2) }} on {{ strftime_now('%Y') | length }}-digit year<|im_end|>
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unexpected role: ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'tool' and loop.index0 > ns.last_user + 5 %}{% break %}{%- endif %}
    {%- if message.content is none %}{% continue %}{%- endif %}
<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
{%- else %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}{{ message.tool_calls | tojson }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
"""
CONVERSATION = [
    {"role": "system", "content": "Réponds en français. 世界"},
    {"role": "user", "content": "héllo 🙂"},
    {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": "ü"}}]},
    {"role": "tool", "content": "{\"ok\": true}"},
    {"role": "assistant", "content": "Done.", "reasoning": "the tool said ok"},
    {"role": "user", "content": "next"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "ünïcode", "parameters": {}}}]


@pytest.fixture(scope="module")
def rich_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_level(tmp_path_factory.mktemp("rich"), config={"chat_template": RICH})


@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS}, {"enable_thinking": False}, {"add_generation_prompt": False}])
def test_rich_template_matches_transformers(rich_dir: Path, kwargs: dict) -> None:
    ours, theirs = Tokenizer.from_dir(rich_dir), AutoTokenizer.from_pretrained(str(rich_dir))
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, **kwargs)
    assert ours.apply_chat_template(CONVERSATION, **kwargs) == expected


def test_chatml_sees_named_special_tokens(tmp_path: Path) -> None:
    template = "{{ bos_token ~ '|' ~ eos_token ~ '|' ~ pad_token }}{{ messages[0]['content'] }}"
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path, config={"chat_template": template,
                                                                      "bos_token": "<|endoftext|>"}))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert rendered == "<|endoftext|>|<|im_end|>|<|endoftext|>x"


def test_content_parts_are_joined(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    as_parts = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    assert as_parts == tokenizer.apply_chat_template([{"role": "user", "content": "a\nb"}])


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "role must be one of"),
    ([{"content": "x"}], "role must be one of"),
    (["x"], "must be an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ([{"role": "tool", "content": "x"}], "rejected the conversation: unsupported role tool"),
])
def test_bad_conversations_raise_invalid_request(tmp_path: Path, messages: object, match: str) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path))
    with pytest.raises(InvalidRequestError, match=match):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_missing_template_is_an_invalid_request(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path, config={"chat_template": None}))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_syntax_error_is_an_unsupported_model(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="does not parse"):
        Tokenizer.from_dir(write_byte_level(tmp_path, config={"chat_template": "{% for %}"}))


def test_sandbox_blocks_python_internals(tmp_path: Path) -> None:
    escapes = ["{{ messages.__class__.__mro__ }}", "{% set ns = namespace() %}{% set ns._x = 1 %}"]
    for i, template in enumerate(escapes):
        tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path / str(i), config={"chat_template": template}))
        with pytest.raises(InvalidRequestError):
            tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_files_win_and_named_templates_are_chosen(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "config-default"}, {"name": "tool_use", "template": "config-tools"}]
    path = write_byte_level(tmp_path, config={"chat_template": named})
    tokenizer = Tokenizer.from_dir(path)
    user = [{"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(user) == "config-default"
    assert tokenizer.apply_chat_template(user, tools=TOOLS) == "config-tools"
    (path / "chat_template.jinja").write_text("file-default")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text("file-tools")
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.apply_chat_template(user) == "file-default"
    assert tokenizer.apply_chat_template(user, tools=TOOLS) == "file-tools"


def test_several_templates_without_default_is_an_invalid_request(tmp_path: Path) -> None:
    config = {"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}
    tokenizer = Tokenizer.from_dir(write_byte_level(tmp_path, config=config))
    with pytest.raises(InvalidRequestError, match="no 'default'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert json.loads(json.dumps(config))  # the config itself stays valid JSON
