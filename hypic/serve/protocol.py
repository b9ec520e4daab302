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


# ---- structured output and tools (docs/agents.md) ----------------------------------------------

JsonSchema = dict[str, Any] | bool  # a JSON Schema document; its keywords are llguidance's to check
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class JsonSchemaFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: JsonSchema = msgspec.field(default_factory=dict)
    strict: bool | None = None  # true: keywords llguidance lacks are an error; else they are ignored


class TextFormat(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class JsonSchemaResponseFormat(Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class StructuredOutputsField(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of these."""

    json: JsonSchema | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None


class FunctionDefinition(Struct, forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of type object; None: no arguments
    strict: bool | None = None


class Tool(Struct, tag_field="type", tag="function", forbid_unknown_fields=True):
    function: FunctionDefinition


class FunctionRef(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # extension (vLLM)
    guided_json: JsonSchema | str | None = None  # extension (vLLM, older names of structured_outputs)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[PromptItem] | None = None  # text, batch of texts, token ids, batch of token ids
    segments: list[str | list[int]] | None = None  # extension (DESIGN §7): prompt given as segments (texts or ids)
    max_tokens: TokenBudget | None = None  # None: the server's default (docs/agents.md)
    logprobs: TopLogprobs | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: its tokens' logprobs too)
    prompt_logprobs: TopLogprobs | None = None  # extension (vLLM): each prompt token's logprob and k alternatives
    suffix: str | None = None  # unsupported when set
    best_of: int | None = None  # supported only as best_of == n


class TextPart(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, for templates that show it


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: TokenBudget | None = None  # None: the server's default (docs/agents.md)
    max_completion_tokens: TokenBudget | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension: variables of the chat template
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    tool_segments: bool | None = None  # extension: each tool definition a PIC segment; None: server default
    functions: Any = None  # OpenAI's deprecated form of tools: unsupported when set
    function_call: Any = None


class TokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Exactly one of prompt (as /v1/completions reads it) and messages (as /v1/chat/completions)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


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
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's entry of `prompt_logprobs`."""

    logprob: float
    rank: int  # 1: the likeliest token
    decoded_token: str


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # extension (vLLM); token id -> entry


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
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


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


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A call's first delta has its id, type and name; the later ones fragments of its arguments."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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


class DetokenizeResponse(Struct):
    prompt: str


class VersionResponse(Struct):
    version: str


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
