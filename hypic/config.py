"""Engine configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from hypic.fields import Rule, check_fields

CacheMode = Literal["none", "prefix", "naive", "hypic"]
CACHE_MODES: tuple[str, ...] = typing.get_args(CacheMode)
DTYPES: tuple[str, ...] = ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
SEGMENT_STATE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")  # storage of cached T and S0
PIC_SEPARATOR = "<|segment|>"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Defaults serve the bundled model on the best device."""

    model: str | None = None
    """Hugging Face model directory (a path-like is taken as its string); None serves the bundled model."""
    device: str = "auto"
    """"auto" (cuda if present, else cpu), "cpu", "cuda" or "cuda:N"."""
    dtype: str | None = None
    """"bfloat16", "float16" or "float32"; None means bf16 on GPU, fp32 on CPU."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the model's max_position_embeddings."""
    gpu_memory_utilization: float = 0.85
    """This engine's share of the GPU's memory, for weights, activations and caches together; the
    caches never take more than is free, so engines and processes can share a GPU."""
    cpu_cache_bytes: int = 512 << 20
    """Bytes of KV pages + state slots on CPU."""
    block_size: int = 16
    """Tokens per KV page."""
    max_num_seqs: int = 128
    """Most sequences in one step (also the largest CUDA-graph decode batch)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (decode tokens + prefill chunk tokens)."""
    long_prefill_token_threshold: int | None = None
    """While decodes, warm assemblies or other requests are in flight, the most a long prefill (a
    cold PIC segment, or a prompt with no cached piece left and more tokens to go than this) may
    cost in one step, in tokens at context 0: a chunk deep in its context counts its attention too,
    n·(1 + context / L), L measured from the engine's steps (docs/serving.md). Alone, a long
    prefill takes the whole step budget. 0: no cap; None: 512 on a GPU, 64 on CPU."""
    max_waiting: int = 1024
    """Most requests queued before submit() raises an overload error."""
    cache_mode: CacheMode = "hypic"
    """Default cache mode of requests: none (full recompute), prefix (exact prefix cache only),
    naive (the paper's strawman: whole-segment states summed, only the query computed) or hypic."""
    seam_width: int = 8
    """Tokens recomputed on each side of a segment boundary (w)."""
    segment_pool_bytes: int | None = None
    """Byte budget of the public segment pool; None: a quarter of the cache budget."""
    segment_host_bytes: int | None = None
    """Byte budget of the host-memory tier below the segment pool (pinned memory on a GPU): entries
    the pool evicts are demoted there and promoted back on a hit. None: on a GPU engine ten times
    the pool, at most half the free host memory; off on a CPU engine; 0 turns it off."""
    segment_disk_dir: str | None = None
    """Directory of the disk tier below the host tier (needs the host tier); None: no disk tier."""
    segment_disk_bytes: int | None = None
    """Byte budget of the disk tier; None: half the directory's free space at start-up."""
    segment_state_dtype: str | None = None
    """Storage dtype of cached T and S0: "float32" or "bfloat16"; None means the model's precision:
    float32 for a float32 model, else bfloat16 (half the pool bytes; its cost in fidelity is in the
    README's Quality section)."""
    max_segments: int = 256
    """Most segments in one prompt."""
    prefix_cache_fraction: float = 0.5
    """Most state slots that prefix-cache checkpoints may hold, as a fraction of all slots."""
    segment_separator: str = PIC_SEPARATOR
    """Text that splits a prompt into segments."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    seed: int = 0
    """Seed of the default random generator (requests without their own seed)."""
    state_dict: dict | None = field(default=None, compare=False, repr=False)
    """In-memory weights (name -> tensor) used in place of the checkpoint's safetensors."""

    def __post_init__(self) -> None:
        for name in ("model", "segment_disk_dir"):  # a pathlib.Path is a directory name too
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        check_fields(self, _RULES)


def _positive(what: str) -> Rule:
    return Rule(lambda v: v > 0, f"a positive integer ({what})")


_RULES = {
    "device": Rule(lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None, '"auto", "cpu", "cuda" or "cuda:N"'),
    "dtype": Rule(lambda v: v in (None, *DTYPES), f"one of {DTYPES} or None (bf16 on GPU, fp32 on CPU)"),
    "max_model_len": Rule(lambda v: v is None or v > 0, "a positive integer or None (the model's own)"),
    "gpu_memory_utilization": Rule(lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    "cpu_cache_bytes": _positive("bytes"),
    "block_size": _positive("tokens"),
    "max_num_seqs": _positive("sequences"),
    "max_num_batched_tokens": _positive("tokens"),
    "long_prefill_token_threshold": Rule(lambda v: v is None or v >= 0,
                                         "an integer >= 0 (tokens; 0: no cap) or None (512 on a GPU, 64 on CPU)"),
    "max_waiting": _positive("requests"),
    "seam_width": Rule(lambda v: v >= 0, "an integer >= 0 (tokens)"),
    "segment_pool_bytes": Rule(lambda v: v is None or v >= 0, "an integer >= 0 (bytes) or None"),
    "segment_host_bytes": Rule(lambda v: v is None or v >= 0, "an integer >= 0 (bytes; 0: off) or None"),
    "segment_disk_dir": Rule(lambda v: v is None or v != "", "a directory or None (no disk tier)"),
    "segment_disk_bytes": Rule(lambda v: v is None or v > 0, "a positive integer (bytes) or None"),
    "segment_state_dtype": Rule(lambda v: v in (None, *SEGMENT_STATE_DTYPES),
                                f"one of {SEGMENT_STATE_DTYPES} or None (the model's precision)"),
    "max_segments": _positive("segments"),
    "prefix_cache_fraction": Rule(lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
    "segment_separator": Rule(lambda v: v != "", "a non-empty string"),
}
