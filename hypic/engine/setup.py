"""Resolving the configuration into concrete things: device, dtype, model directory, memory plan."""
from __future__ import annotations

import gc
import logging
import os
import shutil
from pathlib import Path

import torch

from hypic.cache.disk_tier import DiskTier
from hypic.cache.segment_store import SegmentLayout
from hypic.cache.tiers import LowerTiers
from hypic.config import EngineConfig
from hypic.errors import InvalidRequestError, UnsupportedModelError
from hypic.models.checkpoint import weights_digest

logger = logging.getLogger("hypic")

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default_model"
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device='cuda' was asked for but no CUDA device is available; use 'cpu'")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]  # EngineConfig checked the name against config.DTYPES


def resolve_segment_state_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """Storage of cached T and S0 (EngineConfig.segment_state_dtype, validated there)."""
    if name is None:
        return torch.float32 if model_dtype == torch.float32 else torch.bfloat16
    return _DTYPES[name]


def resolve_long_prefill_threshold(value: int | None, device: torch.device) -> int:
    """EngineConfig.long_prefill_token_threshold. The defaults keep a step that holds a long chunk
    near a decode step's time: on CPU a prefill chunk's fixed cost is already a decode step's
    (docs/serving.md has the measurements)."""
    if value is not None:
        return value
    return 512 if device.type == "cuda" else 64


def resolve_model_dir(model: str | None) -> Path:
    path = BUNDLED_MODEL if model is None else Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise UnsupportedModelError(
            f"{path} is not a Hugging Face model directory (no config.json); hypic loads local "
            "directories only and never downloads weights")
    return path


def cache_budget_bytes(config: EngineConfig, device: torch.device, activation_tokens: int,
                       hidden_size: int, weight_bytes: int) -> int:
    """Bytes left for KV pages, state slots and the segment pool: this engine's share of the GPU
    (gpu_memory_utilization x total) less its weights and activations, and never more than is free
    (other processes and engines keep what they hold)."""
    if device.type == "cpu":
        return config.cpu_cache_bytes
    # blocks this process freed (an engine closed earlier) stay reserved by torch's caching allocator
    # and would count as taken: release them first
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Activations of the largest step: generous per-token scratch plus a fixed margin.
    reserve = (2 << 30) + activation_tokens * hidden_size * 2 * 64
    return min(int(total * config.gpu_memory_utilization) - weight_bytes, free) - reserve


def segment_host_bytes(config: EngineConfig, device: torch.device, pool_bytes: int) -> int:
    """The host tier's budget: as configured, else on a GPU engine ten pools' worth, at most half
    the free host memory (pinned memory the OS cannot page out: the other half is headroom, and
    pinning takes time, so engines that share a host do not each pin half of it); off on a CPU engine."""
    if config.segment_host_bytes is not None:
        return config.segment_host_bytes
    if device.type != "cuda":
        return 0
    return min(10 * pool_bytes, os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2)


def host_slab_bytes(layout: SegmentLayout, max_model_len: int) -> int:
    """The host arena's unit of growth: 1 GiB, or the power of two that holds the longest possible
    segment's entry (torch's pinned allocator rounds a request up to a power of two anyway)."""
    return 1 << max(30, (layout.entry_bytes(max_model_len) - 1).bit_length())


def build_lower_tiers(config: EngineConfig, device: torch.device, layout: SegmentLayout, pool_bytes: int,
                      fingerprint: str, model_dir: Path, max_model_len: int) -> LowerTiers | None:
    """The segment pool's host tier and, under it, the disk tier (None when the host tier is off)."""
    host_bytes = segment_host_bytes(config, device, pool_bytes)
    if config.segment_disk_dir is not None and host_bytes == 0:
        raise InvalidRequestError("segment_disk_dir needs the host tier: set segment_host_bytes > 0 "
                                  "(disk entries are written from host memory)")
    if host_bytes == 0:
        return None
    disk = None
    if config.segment_disk_dir is not None:
        root = Path(config.segment_disk_dir).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        weights = weights_digest(model_dir, config.state_dict, root / "weights-digests.json")
        capacity = config.segment_disk_bytes or shutil.disk_usage(root).free // 2
        disk = DiskTier(root, capacity, f"{fingerprint}:{weights}", layout)
    return LowerTiers(host_bytes, device, disk, host_slab_bytes(layout, max_model_len))
