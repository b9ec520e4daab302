"""Engine configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hypic.errors import InvalidRequestError

CacheMode = Literal["none", "prefix", "naive", "hypic"]
CACHE_MODES: tuple[str, ...] = ("none", "prefix", "naive", "hypic")
SEGMENT_STATE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")  # storage of cached T and S0
PIC_SEPARATOR = "<|segment|>"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Defaults serve the bundled model on the best device."""

    model: str | None = None
    """Hugging Face model directory; None serves the model bundled in the package."""
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
    max_waiting: int = 1024
    """Most requests queued before submit() raises an overload error."""
    cache_mode: CacheMode = "hypic"
    """Default cache mode of requests: none (full recompute), prefix (exact prefix cache only),
    naive (the paper's strawman: whole-segment states summed, only the query computed) or hypic."""
    seam_width: int = 8
    """Tokens recomputed on each side of a segment boundary (w)."""
    segment_pool_bytes: int | None = None
    """Byte budget of the public segment pool; None: a quarter of the cache budget."""
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
        if self.cache_mode not in CACHE_MODES:
            raise InvalidRequestError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_cache_bytes", "max_waiting"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.prefix_cache_fraction < 1.0:
            raise InvalidRequestError("prefix_cache_fraction must be in [0, 1)")
        if self.seam_width < 0:
            raise InvalidRequestError(f"seam_width must be >= 0, got {self.seam_width}")
        if self.segment_state_dtype not in (None, *SEGMENT_STATE_DTYPES):
            raise InvalidRequestError(f"segment_state_dtype must be one of {SEGMENT_STATE_DTYPES}, "
                                      f"got {self.segment_state_dtype!r}")
        if self.segment_pool_bytes is not None and self.segment_pool_bytes < 0:
            raise InvalidRequestError("segment_pool_bytes must be >= 0")
        if not self.segment_separator:
            raise InvalidRequestError("segment_separator must not be empty")
