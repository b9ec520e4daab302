"""OpenAI-compatible request and response bodies (msgspec Structs).

Requests forbid unknown fields: a parameter hypic does not implement is answered with a 400 naming
it, never silently ignored. Fields OpenAI defines but hypic does not implement yet are declared
(so that an explicit `null` is accepted) and rejected when set; see `unsupported_fields`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from hypic.config import CacheMode

Count = Annotated[int, Meta(ge=1, le=128)]  # n: OpenAI's own upper bound
TokenBudget = Annotated[int, Meta(ge=0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
CacheSalt = Annotated[str, Meta(min_length=1, max_length=256)]
StopList = Annotated[list[str], Meta(max_length=16)]
PromptItem = str | int | list[int]


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class SamplingFields(Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    n: Count = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM): 0 or -1 off
    min_p: float = 0.0  # extension (vLLM)
    seed: int | None = None
    stop: str | StopList | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    skip_special_tokens: bool = True  # extension (vLLM)
    include_stop_str_in_output: bool = False  # extension (vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # end-user id: logged with the request
    cache_salt: CacheSalt | None = None  # isolates one tenant's cached prefixes/segments from another's
    cache_mode: CacheMode | None = None  # extension: none | prefix | naive | hypic; None: server default


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[PromptItem] | None = None  # text, batch of texts, token ids, batch of token ids
    segments: list[str | list[int]] | None = None  # extension (DESIGN §7): prompt given as segments (texts or ids)
    max_tokens: TokenBudget | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool = False  # unsupported when true
    suffix: str | None = None  # unsupported when set
    best_of: int | None = None  # supported only as best_of == n


class TextPart(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None  # unsupported when set
    tool_call_id: Any = None  # unsupported when set


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: TokenBudget | None = None  # None: until the context is full
    max_completion_tokens: TokenBudget | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension: variables of the chat template
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None


class TokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Exactly one of prompt (as /v1/completions reads it) and messages (as /v1/chat/completions)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None  # null on stream chunks but the usage chunk


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None  # null but on the usage chunk


class ModelCard(Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "hypic"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Struct):
    error: ErrorDetail


def unsupported_fields(body: Struct, names: tuple[str, ...]) -> list[str]:
    """Names of declared-but-unimplemented fields the client actually set (null/empty means unset)."""
    return [name for name in names if getattr(body, name) not in (None, [], {}, "none")]


encoder = msgspec.json.Encoder()
