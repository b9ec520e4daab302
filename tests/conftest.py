"""Shared fixtures: tiny checkpoints made here (never downloaded)."""
from __future__ import annotations

import os
from pathlib import Path

if os.environ.get("HYPIC_TRITON_INTERPRET") == "1":
    # before anything imports triton (transformers may): its language functions are made
    # interpreted or compiled once, at import
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from models_util import make_hf_model, save_checkpoint, slow_decay as slow_down  # noqa: E402
from tokenizer_util import write_byte_level  # noqa: E402

EOS_ID = 2  # <|im_end|> in the byte-level test tokenizer

# Tiny models: one intra-op thread is far faster than two contending ones on a 2-core machine.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_model_dir(path: Path, kind: str = "qwen3_5_text", seed: int = 0, slow_decay: bool = False,
                   **overrides: object) -> Path:
    """A tiny random checkpoint of `kind` with a trained byte-level tokenizer beside it.
    slow_decay: linear layers remember hundreds of tokens (random init forgets within a few), so
    that errors early in a prompt still show in the final state."""
    model = make_hf_model(kind, seed=seed, eos_token_id=EOS_ID, **overrides)
    if slow_decay:
        slow_down(model)
    save_checkpoint(model, path)
    write_byte_level(path, vocab_size=300)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3_5"))


@pytest.fixture(scope="session")
def slow_decay_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny_slow_decay"), slow_decay=True)


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3_next"), kind="qwen3_next")
