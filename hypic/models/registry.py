"""Model registry: model_type -> model class, and load_model, the one entry point the engine calls."""
from __future__ import annotations

from pathlib import Path

import torch

from hypic.models.checkpoint import CheckpointReader
from hypic.models.config import TEXT_MODEL_TYPES, HybridConfig
from hypic.models.loader import load_weights
from hypic.models.qwen3_next import HybridModel

# Keyed by the text model type (multimodal configs resolve to theirs in HybridConfig).
MODEL_REGISTRY: dict[str, type[HybridModel]] = {model_type: HybridModel for model_type in TEXT_MODEL_TYPES}


def load_model(path: str, *, device: torch.device, dtype: torch.dtype,
               state_dict: dict[str, torch.Tensor] | None = None) -> HybridModel:
    """Load the text model of the Hugging Face directory `path` (config.json + safetensors). With
    `state_dict` (checkpoint names -> tensors), those weights are used and no safetensors are read."""
    config = HybridConfig.from_pretrained(path)
    model_cls = MODEL_REGISTRY[config.model_type]
    if state_dict is not None:
        reader = CheckpointReader.from_state_dict(state_dict, device)
    else:
        reader = CheckpointReader.from_directory(Path(path), device)
    with reader:
        return load_weights(model_cls, config, reader, device, dtype)
