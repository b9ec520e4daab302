"""Host-built index tensors onto the device without making the host wait for the GPU."""
from __future__ import annotations

import torch


def host_to_device(values: torch.Tensor | list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a host tensor or nested list) as a `dtype` tensor on `device`. On CUDA the copy is
    queued on the stream and the host goes on at once; elsewhere it is a plain copy."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":  # pinning needs CUDA; a CPU target needs no copy at all
        return host.to(device)
    # pinned + non_blocking: a pageable host->device copy would sync the stream
    return host.pin_memory().to(device, non_blocking=True)
