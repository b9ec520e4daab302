"""The linear-attention layer: Gated DeltaNet with a causal conv1d over its q/k/v projection.

Split into pieces so that position-independent caching can run the recurrence itself:
`project` (projections + conv + gates), `recur` (the state update through the kernel) and `output`
(gated norm + out projection). `forward` chains them over a ForwardBatch.
"""
from __future__ import annotations

import torch
from torch import nn

from hypic.engine.forward_batch import ForwardBatch
from hypic.kernels.conv1d import causal_conv1d
from hypic.kernels.gdn import gated_delta_rule
from hypic.kernels.gdn_inputs import gdn_gates, qk_l2norm
from hypic.models.config import HybridConfig
from hypic.models.layers import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    """Weights: in_proj rows are [q (H*K) | k (H*K) | v (HV*V) | z (HV*V) | b (HV) | a (HV)] (one matmul);
    conv1d_weight [conv_dim, W] over the q/k/v channels; A_log, dt_bias [HV] in float32."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim
        self.scale = self.head_k_dim ** -0.5
        self.in_proj = nn.Linear(c.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, c.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)

    def in_projection(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Pre-conv pieces: mixed_qkv [N, conv_dim] (the conv input), z [N, HV, V], b, a [N, HV]."""
        sizes = (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        mixed_qkv, z, b, a = self.in_proj(hidden).split(sizes, dim=-1)
        return mixed_qkv, z.reshape(-1, self.num_v_heads, self.head_v_dim), b, a

    def conv(self, mixed_qkv: torch.Tensor, conv_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Causal conv1d + silu per sequence, reading and updating each sequence's window in conv_pool."""
        return causal_conv1d(mixed_qkv, self.conv1d_weight, None, conv_pool, batch.slots, batch.has_state,
                             batch.cu_seqlens, num_decodes=batch.num_decodes, seq_lens_cpu=batch.seq_lens_cpu,
                             activation="silu")

    def split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv channels -> l2-normalised q, k [N, H, K] and v [N, HV, V]."""
        q, k = qk_l2norm(conv_out, self.num_k_heads, self.head_k_dim)
        v = conv_out[:, 2 * self.key_dim:]
        return q, k, v.reshape(-1, self.num_v_heads, self.head_v_dim)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log-decay g = -exp(A_log) * softplus(a + dt_bias) (float32) and beta = sigmoid(b) [N, HV]."""
        return gdn_gates(a, b, self.A_log, self.dt_bias)

    def project(self, hidden: torch.Tensor, conv_pool: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """(q, k, v, g, beta, z): everything the recurrence and the output need."""
        mixed_qkv, z, b, a = self.in_projection(hidden)
        q, k, v = self.split_heads(self.conv(mixed_qkv, conv_pool, batch))
        g, beta = self.gates(b, a)
        return q, k, v, g, beta, z

    def recur(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              ssm_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Gated delta rule from each sequence's state slot (zeros without state); writes states back."""
        return gated_delta_rule(q, k, v, g, beta, ssm_pool, batch.slots, batch.has_state, batch.cu_seqlens,
                                scale=self.scale, num_decodes=batch.num_decodes, seq_lens_cpu=batch.seq_lens_cpu)

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm per value head, then the out projection: [N, HV, V] -> [N, hidden]."""
        return self.out_proj(self.norm(o, z).reshape(o.shape[0], self.value_dim))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, ssm_pool: torch.Tensor,
                conv_pool: torch.Tensor, linear_index: int) -> torch.Tensor:
        if batch.pic is None:
            q, k, v, g, beta, z = self.project(hidden, conv_pool, batch)
            return self.output(self.recur(q, k, v, g, beta, ssm_pool, batch), z)
        return self.forward_pic(hidden, batch, ssm_pool, conv_pool, linear_index)

    def forward_pic(self, hidden: torch.Tensor, batch: ForwardBatch, ssm_pool: torch.Tensor,
                    conv_pool: torch.Tensor, linear_index: int) -> torch.Tensor:
        """The same layer when the step composes cached interiors or captures cold segments."""
        pic = batch.pic
        mixed_qkv, z, b, a = self.in_projection(hidden)
        q, k, v = self.split_heads(pic.conv(self, mixed_qkv, conv_pool, batch, linear_index))
        g, beta = self.gates(b, a)
        pic.capture_linear(mixed_qkv, k, v, g, beta)
        return self.output(pic.recur(self, q, k, v, g, beta, ssm_pool, batch, linear_index), z)
