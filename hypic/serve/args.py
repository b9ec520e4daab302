"""Command-line options of the server, and what they configure (EngineConfig, ServerSettings)."""
from __future__ import annotations

import argparse
import os
import re

from hypic.config import CACHE_MODES, SEGMENT_STATE_DTYPES, EngineConfig
from hypic.errors import InvalidRequestError
from hypic.serve.agent_args import add_agent_arguments, agent_options
from hypic.serve.limits import RequestLimits
from hypic.serve.state import ServerSettings

_DEFAULTS = EngineConfig()
_LIMITS = RequestLimits()
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_LOG_LEVELS = ("debug", "info", "warning", "error")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m hypic.serve` and `hypic serve`."""
    _add_model_arguments(parser)
    _add_cache_arguments(parser)
    _add_server_arguments(parser)
    _add_limit_arguments(parser)
    _add_parallel_arguments(parser)
    add_agent_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", metavar="PATH", help="Hugging Face model directory (default: the bundled model)")
    group.add_argument("--served-model-name", metavar="NAME", help="model id clients send (default: the directory name)")
    group.add_argument("--device", type=_device, default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    group.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                       help="weights and activations (default: bfloat16 on GPU, float32 on CPU)")
    group.add_argument("--max-model-len", type=_positive_int, metavar="TOKENS",
                       help="longest prompt + output (default: the model's, as far as the cache holds it)")
    group.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    group.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of requests without their own (default: %(default)s)")


def _add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory and caching")
    group.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS.gpu_memory_utilization, metavar="FRACTION",
                       help="fraction of GPU memory for weights, activations and caches (default: %(default)s)")
    group.add_argument("--cpu-cache-bytes", type=_size, default=_DEFAULTS.cpu_cache_bytes, metavar="SIZE",
                       help="bytes of KV pages + state slots on CPU, e.g. 512MiB or 2G (default: %(default)s)")
    group.add_argument("--block-size", type=_positive_int, default=_DEFAULTS.block_size, metavar="TOKENS", help="tokens per KV page (default: %(default)s)")
    group.add_argument("--max-num-seqs", type=_positive_int, default=_DEFAULTS.max_num_seqs, metavar="N",
                       help="most sequences per step (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=_positive_int, default=_DEFAULTS.max_num_batched_tokens, metavar="TOKENS",
                       help="token budget of one step (default: %(default)s)")
    group.add_argument("--long-prefill-token-threshold", type=_non_negative_int, metavar="TOKENS",
                       help="while decodes or other requests are in flight, the most a long prefill (a cold "
                            "segment, a long uncached prompt) costs a step, in tokens at context 0 (deeper "
                            "chunks count their attention); 0: no cap (default: 512 on a GPU, 64 on CPU)")
    group.add_argument("--cache-mode", choices=CACHE_MODES, default=_DEFAULTS.cache_mode,
                       help="default cache mode of requests (a request may set its own): none = full recompute, "
                            "prefix = exact prefix cache only, naive = the paper's strawman, hypic = "
                            "position-independent segments (default: %(default)s)")
    group.add_argument("--seam-width", type=_non_negative_int, default=_DEFAULTS.seam_width, metavar="TOKENS",
                       help="tokens recomputed on each side of a segment boundary (default: %(default)s)")
    group.add_argument("--segment-pool-bytes", type=_size, metavar="SIZE",
                       help="budget of the shared segment cache (default: a quarter of the cache budget)")
    group.add_argument("--segment-host-bytes", type=_size, metavar="SIZE",
                       help="budget of the host-memory tier the segment pool demotes to; 0 turns it off "
                            "(default on a GPU: ten times the pool, at most half the free host memory; off on CPU)")
    group.add_argument("--segment-disk-dir", metavar="DIR",
                       help="directory of a disk tier below the host tier (default: none)")
    group.add_argument("--segment-disk-bytes", type=_size, metavar="SIZE",
                       help="budget of the disk tier (default: half the directory's free space)")
    group.add_argument("--segment-state-dtype", choices=SEGMENT_STATE_DTYPES, default=_DEFAULTS.segment_state_dtype,
                       help="storage of cached segment states (default: the model's precision: float32 for a "
                            "float32 model, else bfloat16)")
    group.add_argument("--max-segments", type=_positive_int, default=_DEFAULTS.max_segments, metavar="N",
                       help="most segments in one prompt (default: %(default)s)")
    group.add_argument("--segment-separator", default=_DEFAULTS.segment_separator, metavar="TEXT",
                       help="text that splits a prompt into segments (default: %(default)s; LMCache: ' # # ')")


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get("HYPIC_API_KEY"), metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize (default: $HYPIC_API_KEY)")
    group.add_argument("--max-waiting", type=_positive_int, default=_DEFAULTS.max_waiting, metavar="N",
                       help="requests queued before new ones get 503 + Retry-After (default: %(default)s)")
    group.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, time in-flight requests get to finish (default: %(default)s)")
    group.add_argument("--log-level", choices=_LOG_LEVELS, default="info", help="(default: %(default)s)")


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("what one request or connection may cost (docs/limits.md)")
    group.add_argument("--max-body-bytes", type=_size, default=_LIMITS.max_body_bytes, metavar="SIZE",
                       help="largest request body; larger ones get 413 (default: 16MiB)")
    group.add_argument("--max-json-depth", type=_positive_int, default=_LIMITS.max_json_depth, metavar="N",
                       help="deepest nesting of a body's arrays and objects (default: %(default)s)")
    group.add_argument("--max-sequences-per-request", type=_positive_int, default=_LIMITS.max_sequences,
                       metavar="N", help="prompts x n of one request (default: %(default)s)")
    group.add_argument("--header-timeout", type=_positive_float, default=_LIMITS.header_timeout_s,
                       metavar="SECONDS", help="a connection's request head, or its next one, must arrive "
                                               "within this (default: %(default)s)")
    group.add_argument("--body-timeout", type=_positive_float, default=_LIMITS.body_timeout_s, metavar="SECONDS",
                       help="a request body must arrive within this after its head (default: %(default)s)")
    group.add_argument("--max-connections", type=_positive_int, default=_LIMITS.max_connections, metavar="N",
                       help="open connections; more are answered 503 and closed (default: %(default)s)")


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("segment parallelism")
    group.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                       help="engine processes; a request's cold segments are prefilled on several at once "
                            "(default: %(default)s, one engine in the server's process)")
    group.add_argument("--gpus", type=_gpu_list, default=None, metavar="LIST",
                       help="GPU ids for the engine processes, e.g. 0,1,2,3 (default: one per worker)")
    group.add_argument("--transport", choices=("auto", "tcp", "nccl"), default="auto",
                       help="data plane between engines: nccl when every engine has a GPU of its own (default: auto)")
    group.add_argument("--router-address", default="tcp://127.0.0.1:0", metavar="URL",
                       help="where engines on other machines join (python -m hypic.dist.worker --router URL)")


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU ids like 0,1,2, got {text!r}") from None
    if len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"GPU ids must be distinct and >= 0, got {text!r}")
    return gpus


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Raises InvalidRequestError for a value EngineConfig refuses."""
    options = dict(
        model=args.model, device=args.device, dtype=None if args.dtype == "auto" else args.dtype,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_cache_bytes=args.cpu_cache_bytes, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_waiting=args.max_waiting,
        cache_mode=args.cache_mode, seam_width=args.seam_width, segment_pool_bytes=args.segment_pool_bytes,
        segment_host_bytes=args.segment_host_bytes, segment_disk_dir=args.segment_disk_dir,
        segment_disk_bytes=args.segment_disk_bytes,
        segment_state_dtype=args.segment_state_dtype, max_segments=args.max_segments,
        segment_separator=args.segment_separator,
        enforce_eager=args.enforce_eager, seed=args.seed,
    )
    return EngineConfig(**options)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    if args.shutdown_grace < 0:
        raise InvalidRequestError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    return ServerSettings(args.served_model_name, args.api_key or None, args.shutdown_grace,
                          workers=args.workers, gpus=args.gpus, transport=args.transport,
                          router_address=args.router_address, limits=request_limits(args), **agent_options(args))


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
        max_sequences=args.max_sequences_per_request, max_segments=args.max_segments,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, max_connections=args.max_connections,
    )


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _size(text: str) -> int:
    """'536870912', '512MiB', '512M', '2g' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size like 536870912, 512MiB or 2G, got {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]
