"""A Hugging Face tokenizer directory: encode, decode, special tokens and the chat template.

Reads `tokenizer.json` with the `tokenizers` library (or converts a tiktoken `tiktoken.model` to the
same kind of backend at load, see `tiktoken_bpe`), `tokenizer_config.json` (special tokens,
add_bos_token/add_eos_token, chat_template), `chat_template.jinja` / `additional_chat_templates/`
(which win over the config's template, as in transformers) and `generation_config.json` (extra eos
ids). `clean_up_tokenization_spaces` is never applied (as in vLLM's streaming output).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers.processors import TemplateProcessing

from hypic.engine.text.tiktoken_bpe import TIKTOKEN_FILE, backend_from_tiktoken, tiktoken_scheme
from hypic.errors import InvalidRequestError, UnsupportedModelError

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})
_NAMED_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


class Tokenizer:
    """Text <-> token ids for one model. Build it with `Tokenizer.from_dir(path)`."""

    def __init__(self, backend: _Backend, config: Mapping[str, Any], templates: Mapping[str, str],
                 generation_eos_ids: Iterable[int] = (), *, sort_tool_keys: bool = False) -> None:
        backend.no_truncation()  # a tokenizer.json may carry training-time truncation/padding
        backend.no_padding()
        self._backend = backend
        self.named_tokens: dict[str, str] = _named_tokens(config)
        """"bos_token", "eos_token", ... -> token text; what chat templates see."""
        _configure_post_processor(backend, config, self.named_tokens)
        self.special_ids: frozenset[int] = _special_ids(backend, config)
        """Ids dropped by `skip_special_tokens`."""
        self.vocab_size: int = 1 + max(backend.get_vocab(with_added_tokens=True).values())
        """1 + the largest id the tokenizer knows (added tokens included); the model may have more rows."""
        eos = {self._token_id("eos_token"), *generation_eos_ids}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if i is not None)
        self.special_prefix, self.special_suffix = _special_affixes(backend)
        """Ids that `encode(..., add_special_tokens=True)` puts before / after the text (e.g. BOS)."""
        self._templates = {name: _compile_template(name, text) for name, text in templates.items()}
        self._sort_tool_keys = sort_tool_keys  # the release's tokenizer code sorts them before rendering

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        backend, sort_tool_keys = _read_backend(path, config)
        generation = _read_json(path / "generation_config.json")
        return cls(backend, config, _read_templates(path, config), _as_ids(generation.get("eos_token_id")),
                   sort_tool_keys=sort_tool_keys)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text on its own, without special tokens (parallel in the Rust backend)."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know (model vocab padding) decode to nothing."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (e.g. 'Ġworld'), or None for an unknown id."""
        return self._backend.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """What one token decodes to on its own (for logprobs); a partial UTF-8 byte reads as U+FFFD."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def to_json(self) -> str:
        """The backend as tokenizer.json text (what llguidance reads), also for a converted tiktoken file."""
        return self._backend.to_str()

    def use_chat_template(self, text: str) -> None:
        """Replaces the model's chat template(s) (a server's --chat-template)."""
        self._templates = {"default": _compile_template("--chat-template", text)}

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Renders the conversation as the model's template does in transformers.

        Extra keyword arguments reach the template (e.g. `enable_thinking=False`, `documents=...`) and
        override the named special tokens. Text-only: content may be a string, None, or a list of
        {"type": "text"} parts (joined with newlines). Message keys set to None are dropped."""
        template = self._template_for(tools)
        tools = _sorted_keys(tools) if self._sort_tool_keys else tools
        context = {**self.named_tokens, **kwargs, "messages": _normalise_messages(messages),
                   "add_generation_prompt": add_generation_prompt, "tools": tools}
        try:
            return template.render(**context)
        except (jinja2.TemplateError, TypeError) as error:
            raise InvalidRequestError(f"the chat template rejected the conversation: {error}") from error

    def _template_for(self, tools: list[dict] | None) -> jinja2.Template:
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if not self._templates:
            raise InvalidRequestError(
                "this model has no chat template (tokenizer_config.json chat_template or chat_template.jinja); "
                "use /v1/completions with a raw prompt, or add a template to the model directory")
        raise InvalidRequestError(f"this model has several chat templates {sorted(self._templates)} and no 'default'")

    def _token_id(self, name: str) -> int | None:
        text = self.named_tokens.get(name)
        return None if text is None else self._backend.token_to_id(text)


# --- loading -------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UnsupportedModelError(f"{path} is not valid JSON: {error}") from error


def _read_backend(path: Path, config: Mapping[str, Any]) -> tuple[_Backend, bool]:
    """The backend, and whether chat templates get the tools with sorted keys."""
    if (path / "tokenizer.json").is_file():
        return _Backend.from_file(str(path / "tokenizer.json")), False
    if (path / TIKTOKEN_FILE).is_file():
        scheme = tiktoken_scheme(path, config)
        return backend_from_tiktoken(path, config, scheme), scheme.sorts_tool_keys
    raise UnsupportedModelError(
        f"{path} has neither tokenizer.json nor {TIKTOKEN_FILE}; hypic needs a fast tokenizer. Create one "
        "with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _token_content(value: str | Mapping[str, Any] | None) -> str | None:
    """tokenizer_config writes a special token as its text or as {"content": text, ...}."""
    return value.get("content") if isinstance(value, Mapping) else value


def _named_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    named = {name: _token_content(config.get(name)) for name in _NAMED_TOKENS}
    return {name: text for name, text in named.items() if text is not None}


def _special_ids(backend: _Backend, config: Mapping[str, Any]) -> frozenset[int]:
    from_backend = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    from_config = {int(i) for i, t in config.get("added_tokens_decoder", {}).items() if t.get("special")}
    return frozenset(from_backend | from_config)


def _configure_post_processor(backend: _Backend, config: Mapping[str, Any], named: Mapping[str, str]) -> None:
    """Explicit add_bos_token / add_eos_token flags decide which ids wrap an encoded text; without
    them the tokenizer.json post-processor does (as in transformers' Llama/Gemma tokenizers)."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    bos, eos = named.get("bos_token"), named.get("eos_token")
    add_bos = bool(config.get("add_bos_token")) and bos is not None and backend.token_to_id(bos) is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None and backend.token_to_id(eos) is not None
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    specials = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _special_affixes(backend: _Backend) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the post-processor adds around a probe text (its special_tokens_mask marks them)."""
    encoding = backend.encode("a", add_special_tokens=True)
    mask, ids = encoding.special_tokens_mask, encoding.ids
    text_positions = [i for i, special in enumerate(mask) if not special]
    first, last = text_positions[0], text_positions[-1]
    return tuple(ids[:first]), tuple(ids[last + 1:])


def _read_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Template files win over the config entry, as in transformers."""
    templates = _config_templates(config.get("chat_template"))
    legacy = _read_json(path / "chat_template.json").get("chat_template")  # older processor-style file
    if isinstance(legacy, str):
        templates["default"] = legacy
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    for file in sorted(extra_dir.glob("*.jinja")) if extra_dir.is_dir() else ():
        templates[file.stem] = file.read_text(encoding="utf-8")
    return templates


def _config_templates(raw: str | list[dict[str, str]] | None) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    return {entry["name"]: entry["template"] for entry in raw}


# --- chat template rendering ---------------------------------------------------------------------


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same calling trick as jinja's own Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_attribute_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set the attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: no HTML escaping, keeps non-ASCII text as is."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates with (sandboxed; templates are untrusted)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=dict)
    return env


_ENVIRONMENT = _environment()


def _compile_template(name: str, text: str) -> jinja2.Template:
    try:
        return _ENVIRONMENT.from_string(text)
    except jinja2.TemplateSyntaxError as error:
        raise UnsupportedModelError(f"chat template {name!r} does not parse: {error} (line {error.lineno})") from error


def _normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    return [_normalise_message(i, m) for i, m in enumerate(messages)]


def _normalise_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """As transformers does: keys set to None are dropped (templates handle a missing key, not None),
    and a reasoning text given under any of its names is visible under all of them."""
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"messages[{index}] must be an object, got {type(message).__name__}")
    if message.get("role") not in CHAT_ROLES:
        raise InvalidRequestError(
            f"messages[{index}].role must be one of {sorted(CHAT_ROLES)}, got {message.get('role')!r}")
    fields = {key: value for key, value in message.items() if value is not None}
    if "content" in fields:
        fields["content"] = _text_content(index, fields["content"])
    reasoning = next((fields[key] for key in _REASONING_FIELDS if key in fields), None)
    if reasoning is not None:
        fields = {"thinking": reasoning, **fields, "reasoning_content": reasoning}
    return fields


def _sorted_keys(value: Any) -> Any:
    """Dicts at every depth with their keys in order (lists keep theirs)."""
    if isinstance(value, Mapping):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


def _text_content(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"messages[{index}].content must be a string or a list of parts")
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(f"messages[{index}].content: only text parts are supported, got {kind!r}")
    return "\n".join(part["text"] for part in content)
