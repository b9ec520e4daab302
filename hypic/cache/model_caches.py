"""Device tensors of the two private caches: paged KV (full layers) and the state slab (linear layers)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hypic.errors import UnsupportedModelError
from hypic.kernels.linear_families import LinearFamily


@dataclass(frozen=True)
class LinearShape:
    """What one linear-attention layer keeps per state slot and per cached segment: its family, its
    state [HV, K, V] and the window of its causal conv1d ([conv_dim, W-1] pre-conv inputs)."""

    family: LinearFamily
    value_heads: int  # HV
    key_dim: int  # K
    value_dim: int  # V
    conv_dim: int  # channels the conv runs over
    conv_kernel: int  # W

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_dim, self.value_dim)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)


@dataclass(frozen=True)
class CacheShape:
    """What one model needs per KV page and per state slot."""

    full_layers: tuple[int, ...]  # layer ids of full-attention layers
    linear_layers: tuple[int, ...]  # layer ids of linear-attention layers
    num_kv_heads: int
    head_dim: int
    linear: tuple[LinearShape, ...]  # per linear layer, in the order of linear_layers
    shared_kv: bool = False  # one page tensor is both K and V (MLA: the latent row, num_kv_heads 1)

    def __post_init__(self) -> None:
        if len(self.linear) != len(self.linear_layers):
            raise ValueError(f"{len(self.linear_layers)} linear layers but {len(self.linear)} linear shapes")
        if len({s.conv_kernel for s in self.linear}) > 1:  # PIC splices the same W-1 tail rows at every layer
            widths = sorted({s.conv_kernel for s in self.linear})
            raise UnsupportedModelError(f"linear layers with different conv widths {widths} are not supported")

    @property
    def conv_kernel(self) -> int:
        """The conv width W of every linear layer (1, no window, without linear layers)."""
        return self.linear[0].conv_kernel if self.linear else 1

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        per_token = self.kv_tensors * self.num_kv_heads * self.head_dim * dtype.itemsize
        return len(self.full_layers) * block_size * per_token

    @property
    def kv_tensors(self) -> int:
        """Page tensors per full layer: K and V, or the one latent."""
        return 1 if self.shared_kv else 2

    def slot_bytes(self, dtype: torch.dtype) -> int:
        return sum(math.prod(s.state_shape) * 4 + math.prod(s.conv_state_shape) * dtype.itemsize
                   for s in self.linear)


class ModelCaches:
    """KV pages [num_blocks, block_size, Hkv, D] per full layer (one tensor for K and V when shared); float32 state
    [num_slots, HV, K, V] and conv window [num_slots, conv_dim, W-1] per linear layer (its own shapes)."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.num_blocks, self.block_size, self.num_slots = shape, num_blocks, block_size, num_slots
        self.kv_device = torch.device(device)
        kv_dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self._kv = {i: _pages(kv_dims, shape.shared_kv, dtype, device) for i in shape.full_layers}
        self._state = {i: (torch.zeros(num_slots, *s.state_shape, dtype=torch.float32, device=device),
                           torch.zeros(num_slots, *s.conv_state_shape, dtype=dtype, device=device))
                       for i, s in zip(shape.linear_layers, shape.linear)}

    def kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of a full-attention layer."""
        return self._kv[layer_id]

    def state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ssm_pool, conv_pool) of a linear-attention layer."""
        return self._state[layer_id]

    def copy_slot(self, src: int, dst: int) -> None:
        _copy_rows([pool for pools in self._state.values() for pool in pools], src, dst)

    def copy_block(self, src: int, dst: int) -> None:
        _copy_rows([cache for caches in self._kv.values() for cache in caches[:self.shape.kv_tensors]], src, dst)


def _pages(dims: tuple[int, ...], shared: bool, dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of one full layer; shared: the same tensor twice."""
    k_cache = torch.zeros(dims, dtype=dtype, device=device)
    return (k_cache, k_cache) if shared else (k_cache, torch.zeros(dims, dtype=dtype, device=device))


def _copy_rows(tensors: list[torch.Tensor], src: int, dst: int) -> None:
    """tensor[dst] = tensor[src] for each, as one foreach copy: a copy per layer and pool cost ~1.3 ms
    of host time per slot (H200 profile of a 40-layer model), on every checkpoint."""
    torch._foreach_copy_([t[dst] for t in tensors], [t[src] for t in tensors])
