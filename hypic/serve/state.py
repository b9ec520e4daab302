"""What every handler needs: the engine client, the server's settings and its metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from hypic.engine.client import EngineClient
from hypic.serve.limits import RequestLimits
from hypic.serve.memory import LargeBodies
from hypic.serve.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str | None = None  # None: the engine's model name
    api_key: str | None = None  # None: no authentication
    shutdown_grace_s: float = 30.0
    limits: RequestLimits = RequestLimits()
    workers: int = 1  # engine processes (segment parallelism); 1: the engine runs in this process
    gpus: tuple[int, ...] | None = None
    transport: str = "auto"
    router_address: str = "tcp://127.0.0.1:0"
    chat_template: str | None = None  # --chat-template: replaces the model's template
    tool_call_parser: str | None = None  # hermes | qwen3_coder; None: what the chat template writes
    reasoning_parser: str | None = None  # qwen3; None: replies are all content
    tool_segments: bool = False  # each tool definition its own PIC segment (requests may override)
    max_tokens_default: int | None = None  # a request without max_tokens; None: the rest of the context


@dataclass
class ServerState:
    client: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    max_prompt_chars: int  # more characters than this cannot fit the context even at the longest token
    draining: bool = False  # set once shutdown begins: new requests get 503
    large_bodies: LargeBodies = field(default_factory=LargeBodies)  # see read_body

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.client.info.model_name


STATE = web.AppKey("hypic_state", ServerState)
