"""hypic: async serving of hybrid-attention LLMs with position-independent caching."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from hypic.config import CACHE_MODES, PIC_SEPARATOR, EngineConfig
from hypic.errors import (EngineDeadError, EngineOverloadedError, HypicError, InvalidRequestError,
                          OutOfMemoryError, PromptTooLongError, StepOutOfMemoryError, UnsupportedModelError)
from hypic.outputs import CompletionDelta, RequestMetrics, RequestOutput, TokenLogprob
from hypic.sampling_params import SamplingParams

try:
    __version__ = version("hypic")
except PackageNotFoundError:  # a source tree on PYTHONPATH that pip never installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncEngine", "CACHE_MODES", "CompletionDelta", "EngineConfig", "EngineDeadError",
    "EngineOverloadedError", "HypicError", "InvalidRequestError", "OutOfMemoryError", "PIC_SEPARATOR",
    "PromptTooLongError", "RequestMetrics", "RequestOutput", "SamplingParams", "StepOutOfMemoryError",
    "TokenLogprob", "UnsupportedModelError",
]


def __getattr__(name: str):
    # AsyncEngine pulls in torch and the model code; import it only when asked for.
    if name == "AsyncEngine":
        from hypic.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module 'hypic' has no attribute {name!r}")
