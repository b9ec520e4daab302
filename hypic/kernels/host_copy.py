"""Host-built index tensors onto the device without making the host wait for the GPU."""
from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch


def host_to_device(values: torch.Tensor | list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a host tensor or nested list) as a `dtype` tensor on `device`. On CUDA the copy is
    queued on the stream and the host goes on at once; elsewhere it is a plain copy."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":  # pinning needs CUDA; a CPU target needs no copy at all
        return host.to(device)
    # pinned + non_blocking: a pageable host->device copy would sync the stream
    return host.pin_memory().to(device, non_blocking=True)


# bytes: each packed tensor starts where any dtype's view of it is aligned, and 16-byte aligned whatever
# the step's sizes: Triton specialises kernels on a pointer's 16-byte alignment, so a batch whose
# tensors landed 8 bytes off would compile them again
_ALIGN = 16


def packed_offsets(sizes: list[int]) -> list[int]:
    """Where tensors of `sizes` bytes start in one packed buffer (each at a multiple of _ALIGN), then its size."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // _ALIGN) * _ALIGN)
    return offsets


def host_to_device_packed(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors onto `device` in one pinned copy (one launch instead of one per tensor), each
    coming back as a view of the one device buffer; elsewhere than CUDA they are returned as they are."""
    if torch.device(device).type != "cuda":
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = packed_offsets(sizes)
    staging = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True)
    for tensor, start, size in zip(tensors, offsets, sizes):
        staging[start:start + size] = tensor.contiguous().view(-1).view(torch.uint8)
    moved = staging.to(device, non_blocking=True)
    return [moved[start:start + size].view(t.dtype).view(t.shape) for t, start, size in zip(tensors, offsets, sizes)]


def read_rows(columns: list[torch.Tensor]) -> list[list[float]]:
    """[M, k_i] device tensors side by side as M host rows, in one device-to-host read (one sync, not
    one per tensor); float64 keeps float32 values and integer ids below 2^53 exact."""
    return torch.cat([c.double() for c in columns], dim=1).tolist()


def sync_sites(run: Callable[[], object]) -> list[str]:
    """The host syncs `run` makes on CUDA (torch's sync debug mode), each named by the innermost
    hypic lines that caused it: what a step that should never wait for the GPU is checked with."""
    sites: list[str] = []

    def record(*_args, **_kwargs) -> None:
        frames = [f for f in traceback.extract_stack() if "/hypic/" in f.filename]
        sites.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1]))

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sites
