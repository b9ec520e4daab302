"""Read the tensors of a Hugging Face checkpoint (single or sharded safetensors, or an in-memory dict)
under canonical text-model names: the text prefix is stripped, vision and MTP weights are set aside."""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from hypic.errors import UnsupportedModelError

# multimodal saves first, then text-only; Nemotron-H ships (and transformers saves) backbone.*
TEXT_PREFIXES: tuple[str, ...] = ("model.language_model.", "model.", "backbone.")
SKIPPED_PREFIXES: tuple[str, ...] = ("mtp.", "model.mtp.", "backbone.mtp.", "model.visual.", "visual.")  # served by no one here
SKIPPED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)  # stale buffers some older saves carry
LM_HEAD = "lm_head.weight"


def canonical_names(names: list[str]) -> tuple[dict[str, str], list[str]]:
    """Map canonical names ("layers.3.mlp.gate_proj.weight", "lm_head.weight") to stored names; also return
    the stored names that fit no text-model slot and are not skipped on purpose."""
    kept = [n for n in names if not n.startswith(SKIPPED_PREFIXES) and not n.endswith(SKIPPED_SUFFIXES)]
    prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p) for n in kept)), None)
    mapping, strays = {}, []
    for name in kept:
        if name == LM_HEAD:
            mapping[name] = name
        elif prefix is not None and name.startswith(prefix):
            mapping[name[len(prefix):]] = name
        else:
            strays.append(name)
    return mapping, strays


class CheckpointReader:
    """Canonical name -> tensor on `device`. Use as a context manager (it keeps shard files open)."""

    def __init__(self, stored: dict[str, object], device: torch.device) -> None:
        self._stored = stored  # stored name -> open safetensors file or a tensor
        self._device = device
        self.names, self.strays = canonical_names(list(stored))
        self._files = ExitStack()

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, torch.Tensor], device: torch.device) -> CheckpointReader:
        return cls(dict(state_dict), device)

    @classmethod
    def from_directory(cls, path: str | Path, device: torch.device) -> CheckpointReader:
        files = _safetensors_files(Path(path))
        stack = ExitStack()
        stored: dict[str, object] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device=_safetensors_device(device)))
            stored.update({name: handle for name in handle.keys()})
        reader = cls(stored, device)
        reader._files = stack
        return reader

    def get(self, canonical: str) -> torch.Tensor:
        stored_name = self.names[canonical]
        source = self._stored[stored_name]
        tensor = source if isinstance(source, torch.Tensor) else source.get_tensor(stored_name)
        return tensor.to(self._device)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(
            f"no *.safetensors weights in {path}; hypic loads safetensors checkpoints only (convert .bin first)")
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise UnsupportedModelError(f"checkpoint shards listed in the index are missing: {', '.join(absent)}")
    return files


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def weights_digest(path: str | Path, state_dict: dict[str, torch.Tensor] | None, memo: Path) -> str:
    """A digest of the weights themselves (a fine-tune with the same config.json differs): every
    safetensors file's name, size and contents, or every in-memory tensor. Hashing a large
    checkpoint takes seconds, so a file's digest is remembered in `memo` (JSON) under its path,
    size and modification time."""
    if state_dict is not None:
        return _tensors_digest(state_dict)
    known = json.loads(memo.read_text()) if memo.is_file() else {}
    parts = [_file_digest(file, known) for file in _safetensors_files(Path(path))]
    memo.write_text(json.dumps(known))
    return xxhash.xxh3_128("|".join(parts).encode()).hexdigest()


def _tensors_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """Every tensor's name, dtype, shape and bytes. Device tensors pass through one pinned staging
    buffer: tens of GB of `.cpu()` copies into fresh pageable memory took tens of seconds."""
    h = xxhash.xxh3_128()
    on_device = [t for t in state_dict.values() if t.device.type != "cpu"]
    largest = max((t.numel() * t.element_size() for t in on_device), default=0)
    staging = torch.empty(largest, dtype=torch.uint8, pin_memory=any(t.is_cuda for t in on_device))
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        raw = tensor.reshape(-1).view(torch.uint8)
        if tensor.device.type != "cpu":
            raw = staging[:raw.numel()].copy_(raw)
        h.update(raw.numpy())  # hashed in place
    return h.hexdigest()


def _file_digest(file: Path, known: dict[str, str]) -> str:
    stat = file.stat()
    name = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    if name not in known:
        h = xxhash.xxh3_128()
        with open(file, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
        known[name] = h.hexdigest()
    return f"{file.name}:{stat.st_size}:{known[name]}"
