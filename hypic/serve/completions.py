"""POST /v1/completions."""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from msgspec.structs import replace

from hypic.engine.text.tokenizer import Tokenizer
from hypic.outputs import RequestOutput, TokenLogprob
from hypic.sampling_params import SamplingParams
from hypic.serve.choices import ChoiceBuffer, choice_index, collect, worth_sending
from hypic.engine.client import GenerateRequest
from hypic.serve.http_errors import bad_request, engine_errors
from hypic.serve.logprobs import completion_logprobs, vllm_prompt_logprobs
from hypic.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse, PromptLogprob
from hypic.serve.request_body import check_model, check_prompts, check_stream_options, read_body, reject_unsupported
from hypic.serve.request_group import submitted
from hypic.serve.responses import event, json_response, stream_events
from hypic.serve.sampling import or_default, sampling_params
from hypic.serve.state import STATE
from hypic.serve.structured import requested_constraint

log = logging.getLogger(__name__)
_PARAM_NAMES = {name: name for name in CompletionRequest.__struct_fields__}

Prompt = str | list[str] | list[int] | list[list[int]]


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, CompletionRequest)
    check_model(state, body.model)
    _reject_unsupported(body)
    check_stream_options(body.stream, body.stream_options)
    prompts = completion_prompts(body)
    check_prompts(state, prompts, body.n)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    log.debug("%s: %d prompt(s), n=%d, user=%s", request_id, len(prompts), body.n, body.user)
    with engine_errors(_PARAM_NAMES):
        params = sampling_params(body, max_tokens=or_default(body.max_tokens, state.settings), logprobs=body.logprobs,
                                 structured=requested_constraint(body))
        returns = PromptReturn.of(body, prompts, state.client.tokenizer)
        jobs = _engine_requests(body, prompts, params, returns, request_id)
        async with submitted(state.client, jobs, state.metrics) as outputs:
            head = CompletionResponse(request_id, int(time.time()), state.model_name, [])
            if body.stream:
                return await _stream(request, outputs, head, body, returns)
            return await _respond(outputs, head, body, len(prompts), returns)


def _engine_requests(body: CompletionRequest, prompts: list[Prompt], params: SamplingParams, returns: PromptReturn,
                     request_id: str) -> list[GenerateRequest]:
    """One per prompt. The engine recomputes a prompt it scores (cache mode none); saying so here
    keeps workers from prefilling its segments."""
    params = dataclasses.replace(params, prompt_logprobs=returns.scored_k)
    cache_mode = body.cache_mode if returns.scored_k is None else "none"
    return [GenerateRequest(prompt, params, f"{request_id}-{index}", body.cache_salt, cache_mode, group=request_id)
            for index, prompt in enumerate(prompts)]


def completion_prompts(body: CompletionRequest) -> list[Prompt]:
    """One engine prompt per element of a batch; `segments` is one prompt given as segments."""
    if body.segments is not None:
        if body.prompt is not None:
            raise bad_request("send either prompt or segments, not both", "segments")
        return [body.segments]
    prompt = body.prompt
    if prompt is None:
        raise bad_request("prompt is required (or the segments extension field)", "prompt")
    if isinstance(prompt, str) or (prompt and all(isinstance(item, int) for item in prompt)):
        return [prompt]
    if prompt and (all(isinstance(item, str) for item in prompt) or all(isinstance(item, list) for item in prompt)):
        return list(prompt)
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt"
    )


def echo_text(prompt: Prompt | list[str | list[int]], tokenizer: Tokenizer) -> str:
    """The text `echo` puts before the completion: a prompt given as text is echoed as it came."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(item, int) for item in prompt):
        return tokenizer.decode(prompt, skip_special_tokens=False)
    return "".join(echo_text(part, tokenizer) for part in prompt)  # segments


@dataclass
class PromptReturn:
    """What the choices return of their prompt: its text (echo), its tokens' logprobs in OpenAI's
    legacy format (echo with logprobs) and in vLLM's (prompt_logprobs). Those logprobs arrive with
    the prompt's first output."""

    texts: list[str] | None  # None: no echo
    echo_k: int | None  # alternatives per echoed token (logprobs)
    vllm_k: int | None  # alternatives per token of vLLM's prompt_logprobs
    logprobs: dict[int, tuple[TokenLogprob, ...]] = field(default_factory=dict)  # prompt index -> tokens

    @classmethod
    def of(cls, body: CompletionRequest, prompts: list[Prompt], tokenizer: Tokenizer) -> PromptReturn:
        texts = [echo_text(prompt, tokenizer) for prompt in prompts] if body.echo else None
        return cls(texts, body.logprobs if body.echo else None, body.prompt_logprobs)

    @property
    def scored_k(self) -> int | None:
        """The alternatives the engine scores each prompt token with; None: no prompt scoring."""
        return max((k for k in (self.echo_k, self.vllm_k) if k is not None), default=None)

    def note(self, prompt_index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.logprobs[prompt_index] = output.prompt_logprobs

    def before(self, prompt_index: int, text: str, items: Sequence[TokenLogprob]) -> tuple[str, list[TokenLogprob]]:
        """A choice's text and logprobs with the echoed prompt in front (as they are without echo)."""
        if self.texts is None:
            return text, list(items)
        prompt = [dataclasses.replace(item, top=item.top[:self.echo_k]) for item in self.logprobs.get(prompt_index, ())]
        return self.texts[prompt_index] + text, [*prompt, *items]

    def vllm(self, prompt_index: int) -> list[dict[str, PromptLogprob] | None] | None:
        if self.vllm_k is None or prompt_index not in self.logprobs:
            return None
        return vllm_prompt_logprobs(self.logprobs[prompt_index], self.vllm_k)


async def _noted(outputs: AsyncIterator[tuple[int, RequestOutput]], returns: PromptReturn
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for prompt_index, output in outputs:
        returns.note(prompt_index, output)
        yield prompt_index, output


def _reject_unsupported(body: CompletionRequest) -> None:
    unsupported = ["suffix"] if body.suffix else []
    unsupported += ["best_of"] if body.best_of not in (None, body.n) else []
    reject_unsupported(unsupported)


async def _respond(
    outputs: AsyncIterator[tuple[int, RequestOutput]], head: CompletionResponse, body: CompletionRequest,
    num_prompts: int, returns: PromptReturn,
) -> web.Response:
    buffers, usage = await collect(_noted(outputs, returns), body.n, num_prompts)
    choices = [_choice(index, buffer, body, returns) for index, buffer in enumerate(buffers)]
    return json_response(replace(head, choices=choices, usage=usage.usage()))


def _choice(index: int, buffer: ChoiceBuffer, body: CompletionRequest, returns: PromptReturn) -> CompletionChoice:
    text, items = returns.before(index // body.n, buffer.text, buffer.logprobs)
    logprobs = completion_logprobs(items, 0) if body.logprobs is not None else None
    return CompletionChoice(index, text, logprobs, buffer.finish_reason, returns.vllm(index // body.n))


async def _stream(
    request: web.Request, outputs: AsyncIterator[tuple[int, RequestOutput]], head: CompletionResponse,
    body: CompletionRequest, returns: PromptReturn,
) -> web.StreamResponse:
    offsets: dict[int, int] = {}
    return await stream_events(request, _noted(outputs, returns), head,
                               lambda index, output: _chunks(head, index, output, body, offsets, returns),
                               stream_options=body.stream_options, param_names=_PARAM_NAMES)


def _chunks(
    head: CompletionResponse, prompt_index: int, output: RequestOutput, body: CompletionRequest,
    offsets: dict[int, int], returns: PromptReturn,
) -> bytes:
    """A choice's first chunk carries what it returns of the prompt."""
    chunks = []
    for delta in filter(worth_sending, output.deltas):
        index = choice_index(prompt_index, body.n, delta)
        first = index not in offsets
        text, tokens = returns.before(prompt_index, delta.text, delta.logprobs or ()) if first else (
            delta.text, delta.logprobs or ())
        offset = offsets.get(index, 0)
        offsets[index] = offset + sum(len(item.token) for item in tokens)
        logprobs = completion_logprobs(tokens, offset) if body.logprobs is not None else None
        prompt_logprobs = returns.vllm(prompt_index) if first else None
        choice = CompletionChoice(index, text, logprobs, delta.finish_reason, prompt_logprobs)
        chunks.append(event(replace(head, choices=[choice])))
    return b"".join(chunks)
