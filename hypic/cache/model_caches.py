"""Device tensors of the two private caches: paged KV (full layers) and the state slab (linear layers)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    linear_value_heads: int  # HV
    linear_key_dim: int  # K
    linear_value_dim: int  # V
    conv_dim: int  # channels of the causal conv1d (q, k and v projections)
    conv_kernel: int  # conv width W; the window keeps W - 1 inputs

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * self.num_kv_heads * self.head_dim * dtype.itemsize
        return len(self.full_layers) * block_size * per_token

    def slot_bytes(self, dtype: torch.dtype) -> int:
        ssm = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim * 4
        conv = self.conv_dim * (self.conv_kernel - 1) * dtype.itemsize
        return len(self.linear_layers) * (ssm + conv)


class ModelCaches:
    """KV pages [num_blocks, block_size, Hkv, D] per full layer; float32 state
    [num_slots, HV, K, V] and conv window [num_slots, conv_dim, W-1] per linear layer."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.num_blocks, self.block_size, self.num_slots = shape, num_blocks, block_size, num_slots
        self.kv_device = torch.device(device)
        kv_dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self._kv = {i: (torch.zeros(kv_dims, dtype=dtype, device=device),
                        torch.zeros(kv_dims, dtype=dtype, device=device)) for i in shape.full_layers}
        ssm_dims = (num_slots, shape.linear_value_heads, shape.linear_key_dim, shape.linear_value_dim)
        conv_dims = (num_slots, shape.conv_dim, shape.conv_kernel - 1)
        self._state = {i: (torch.zeros(ssm_dims, dtype=torch.float32, device=device),
                           torch.zeros(conv_dims, dtype=dtype, device=device)) for i in shape.linear_layers}

    def kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of a full-attention layer."""
        return self._kv[layer_id]

    def state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ssm_pool, conv_pool) of a linear-attention layer."""
        return self._state[layer_id]

    def copy_slot(self, src: int, dst: int) -> None:
        _copy_rows([pool for pools in self._state.values() for pool in pools], src, dst)

    def copy_block(self, src: int, dst: int) -> None:
        _copy_rows([cache for caches in self._kv.values() for cache in caches], src, dst)


def _copy_rows(tensors: list[torch.Tensor], src: int, dst: int) -> None:
    """tensor[dst] = tensor[src] for each, as one foreach copy: a copy per layer and pool cost ~1.3 ms
    of host time per slot (H200 profile of a 40-layer model), on every checkpoint."""
    torch._foreach_copy_([t[dst] for t in tensors], [t[src] for t in tensors])
