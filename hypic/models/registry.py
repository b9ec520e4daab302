"""Model registry: model_type -> (config, model class, weight recipes), and load_model, the one entry
point the engine calls."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hypic.errors import UnsupportedModelError
from hypic.models.checkpoint import CheckpointReader
from hypic.models.config import (MULTIMODAL_MODEL_TYPES, TEXT_MODEL_TYPES, HybridConfig, read_config_json,
                                 with_generation_eos)
from hypic.models.loader import RecipesFn, load_weights, weight_recipes
from hypic.models.mamba2_config import MAMBA2_MODEL_TYPES, Mamba2HybridConfig
from hypic.models.mamba2_hybrid import Mamba2HybridModel
from hypic.models.mamba2_weights import mamba2_weight_recipes
from hypic.models.qwen3_next import HybridModel


@dataclass(frozen=True)
class Architecture:
    config_cls: Any  # parses a config.json dict: from_dict(dict) -> config
    model_cls: type[nn.Module]
    recipes: RecipesFn


_QWEN = Architecture(HybridConfig, HybridModel, weight_recipes)
_MAMBA2 = Architecture(Mamba2HybridConfig, Mamba2HybridModel, mamba2_weight_recipes)
# Keyed by config.json's model_type (a multimodal Qwen config resolves to its text model in HybridConfig).
MODEL_REGISTRY: dict[str, Architecture] = {
    **{t: _QWEN for t in TEXT_MODEL_TYPES + tuple(MULTIMODAL_MODEL_TYPES)}, **{t: _MAMBA2 for t in MAMBA2_MODEL_TYPES}}


def architecture(config: dict[str, Any]) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in MODEL_REGISTRY:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; hypic serves {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_type]


def load_config(path: str | Path) -> HybridConfig | Mamba2HybridConfig:
    """The parsed config of the Hugging Face directory `path`, eos ids of generation_config.json added."""
    return _architecture_and_config(path)[1]


def _architecture_and_config(path: str | Path) -> tuple[Architecture, Any]:
    raw = read_config_json(path)
    arch = architecture(raw)
    return arch, with_generation_eos(arch.config_cls.from_dict(raw), path)


def load_model(path: str, *, device: torch.device, dtype: torch.dtype,
               state_dict: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Load the text model of the Hugging Face directory `path` (config.json + safetensors). With
    `state_dict` (checkpoint names -> tensors), those weights are used and no safetensors are read."""
    arch, config = _architecture_and_config(path)
    if state_dict is not None:
        reader = CheckpointReader.from_state_dict(state_dict, device)
    else:
        reader = CheckpointReader.from_directory(Path(path), device)
    with reader:
        return load_weights(arch.model_cls, config, reader, device, dtype, arch.recipes)
