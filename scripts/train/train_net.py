"""Qwen3.5 text model in plain torch, for training: same parameter names and math as transformers.

Why not train the transformers model itself: where flash-linear-attention is installed transformers
dispatches to its Triton kernels, whose backward refuses Triton < 3.7.1 on Hopper. Here the Gated
DeltaNet runs as a chunked torch recurrence (fp32, differentiable), attention through SDPA, and
the LM head is applied only at supervised positions. tests/test_data_train_net.py checks the
logits against transformers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + weight), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm (weight starts at one) followed by a SiLU gate."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, chunk: int) -> torch.Tensor:
    """Gated delta rule from a zero state. q, k, v: [B, H, T, D] fp32 (q scaled, q/k unit norm);
    g, beta: [B, H, T]; T a multiple of `chunk`. S_t = e^g_t (I - b_t k_t k_t^T) S_t-1 + b_t k_t v_t^T,
    o_t = S_t^T q_t. Inside a chunk the delta updates u solve (I + A) u = b (v - e^c K S0) with
    A_tj = b_t e^(c_t - c_j) k_t.k_j (j < t), c the in-chunk cumulative log decay."""
    b, h, t, d = k.shape
    n = t // chunk
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    c = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # e^(c_t - c_j), j <= t
    kk = (k @ k.transpose(-1, -2)) * decay
    system = torch.eye(chunk, device=q.device) + (beta.unsqueeze(-1) * kk).tril(-1)
    rhs = torch.cat((beta.unsqueeze(-1) * v, (beta * c.exp()).unsqueeze(-1) * k), -1)  # one solve for both
    u0, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([v.shape[-1], d], -1)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed, k_to_end = q * c.exp().unsqueeze(-1), k * (c[..., -1:] - c).exp().unsqueeze(-1)
    state = q.new_zeros(b, h, d, v.shape[-1])
    outs = []
    for i in range(n):  # invariant: `state` is S at the end of chunk i - 1
        u = u0[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ u)
        state = state * c[:, :, i, -1:].exp().unsqueeze(-1) + k_to_end[:, :, i].transpose(-1, -2) @ u
    return torch.stack(outs, 2).reshape(b, h, t, -1)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: dict, chunk: int) -> None:
        super().__init__()
        self.hk, self.hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.dk, self.dv, self.chunk = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], chunk
        hidden, key_dim, value_dim = cfg["hidden_size"], self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * key_dim + value_dim
        width = cfg["linear_conv_kernel_dim"]
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, padding=width - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, cfg["rms_norm_eps"])
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.hv, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.hv, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, t, _ = x.shape
        mixed = F.silu(self.conv1d(self.in_proj_qkv(x).transpose(1, 2))[..., :t]).transpose(1, 2)
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], -1)
        rep = self.hv // self.hk  # value head j reads key head j // rep
        q, k = (l2norm(y.float().reshape(bsz, t, self.hk, self.dk)).repeat_interleave(rep, 2) for y in (q, k))
        v = v.float().reshape(bsz, t, self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        q, k, v, g, beta = (y.transpose(1, 2) for y in (q * self.dk**-0.5, k, v, g, beta))
        pad = -t % self.chunk
        if pad:
            q, k, v = (F.pad(y, (0, 0, 0, pad)) for y in (q, k, v))
            g, beta = (F.pad(y, (0, pad)) for y in (g, beta))
        with torch.autocast(x.device.type, enabled=False):  # the recurrence stays in fp32
            o = chunked_delta_rule(q, k, v, g, beta, self.chunk)[:, :, :t].transpose(1, 2)
        z = self.in_proj_z(x).reshape(bsz, t, self.hv, self.dv)
        return self.out_proj(self.norm(o.to(z.dtype), z).reshape(bsz, t, -1))


def rope_tables(cfg: dict, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rope = cfg["rope_parameters"]
    dim = int(cfg["head_dim"] * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))
    freqs = torch.arange(length, device=device, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; rotates the first cos.shape[-1] dims (half-split pairs), keeps the rest."""
    rot, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
    x1, x2 = rot.chunk(2, -1)
    rotated = rot * cos.to(x.dtype) + torch.cat((-x2, x1), -1) * sin.to(x.dtype)
    return torch.cat((rotated, rest), -1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, self.d = cfg["hidden_size"], cfg["head_dim"]
        self.hq, self.hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.q_proj = nn.Linear(hidden, self.hq * self.d * 2, bias=False)
        self.k_proj = nn.Linear(hidden, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(hidden, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, hidden, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.d, cfg["rms_norm_eps"]), RMSNorm(self.d, cfg["rms_norm_eps"])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        bsz, t, _ = x.shape
        q, gate = self.q_proj(x).view(bsz, t, self.hq, 2 * self.d).chunk(2, -1)
        q = apply_rope(self.q_norm(q).transpose(1, 2), *rope)
        k = apply_rope(self.k_norm(self.k_proj(x).view(bsz, t, self.hkv, self.d)).transpose(1, 2), *rope)
        v = self.v_proj(x).view(bsz, t, self.hkv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, enable_gqa=True)
        o = o.transpose(1, 2).reshape(bsz, t, -1) * torch.sigmoid(gate.reshape(bsz, t, -1))
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_type: str, chunk: int) -> None:
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, chunk)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h) if self.is_linear else self.self_attn(h, rope))
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, cfg: dict, chunk: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, chunk) for kind in cfg["layer_types"])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


@torch.no_grad()
def respread_rows(weight: torch.Tensor, rows: list[int], norm: float, generator: torch.Generator) -> None:
    """Gives embedding rows that have collapsed onto one direction fresh random deviations of size `norm`
    around their (kept) mean. With tied embeddings a value class the model never copies (single-token cities
    and jobs in the GPU checkpoint of .notes/TRAINING.md: pairwise cosine 0.90 / 0.96) ends up as one shared
    "type" vector: the output gradient of a context-independent prediction pushes every row of the class along
    the same hidden state, so neither the input nor the output can tell the members apart any more and copying
    has nothing to copy. The mean keeps the type information the trained layers read."""
    x = weight[rows].float()
    noise = torch.randn(x.shape, generator=generator).to(x.device)
    noise = noise * (norm / noise.norm(dim=-1, keepdim=True))
    weight[rows] = (x.mean(0) + noise - noise.mean(0)).to(weight.dtype)


@torch.no_grad()
def collapse_rows(weight: torch.Tensor, rows: list[int], ratio: float, generator: torch.Generator) -> None:
    """The reverse (for probes): adds one shared random direction of `ratio` times the rows' mean norm."""
    x = weight[rows].float()
    u = torch.randn(x.shape[-1], generator=generator).to(x.device)
    weight[rows] = (x + u * (ratio * x.norm(dim=-1).mean() / u.norm())).to(weight.dtype)


@torch.no_grad()
def mlp_neuron_peaks(net: Qwen35ForTraining, sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per layer, each MLP neuron's largest output norm |activation| * |down_proj column| over the given
    (token ids, positions) pairs (run 8's checkpoint: 1-3 neurons of the last layer write ~2e4 at the position
    that predicts a city, where every other answer's final residual is ~1e3)."""
    layers = net.model.layers
    peaks = [torch.zeros(layer.mlp.down_proj.in_features) for layer in layers]
    acts: list[torch.Tensor] = []
    hooks = [layer.mlp.down_proj.register_forward_hook(lambda m, i, o: acts.append(i[0])) for layer in layers]
    try:
        device = next(net.parameters()).device
        for ids, positions in sequences:
            acts.clear()
            net.hidden_states(torch.tensor([ids], device=device))
            for peak, act, layer in zip(peaks, acts, layers):
                col = layer.mlp.down_proj.weight.float().norm(dim=0)
                out = (act[0, positions].float().abs() * col).amax(0).cpu()
                torch.maximum(peak, out, out=peak)
    finally:
        for h in hooks:
            h.remove()
    return peaks


@torch.no_grad()
def cap_mlp_neurons(net: Qwen35ForTraining, peaks: list[torch.Tensor], cap: float) -> list[tuple[int, int, float]]:
    """Scales the down_proj column of every MLP neuron whose peak output norm exceeds `cap` down to `cap`.
    The final RMSNorm divides the residual by its norm, so one neuron writing ~2e4 (a context-free "the answer
    is some city" prior) leaves every attention head (outputs ~1e2-1e3) with ~1 % of the prediction and of its
    gradient: copying a city from the context can then never be learned. Returns (layer, neuron, peak)."""
    capped = []
    for index, (layer, peak) in enumerate(zip(net.model.layers, peaks)):
        for neuron in torch.nonzero(peak > cap).flatten().tolist():
            layer.mlp.down_proj.weight[:, neuron] *= cap / peak[neuron].item()
            capped.append((index, neuron, peak[neuron].item()))
    return capped


def deviation_norm(weight: torch.Tensor, rows: list[int]) -> float:
    """Mean distance of the rows from their mean (how distinct a class's members are)."""
    x = weight[rows].float()
    return (x - x.mean(0)).norm(dim=-1).mean().item()


class Qwen35ForTraining(nn.Module):
    """`model.*` parameters as in Qwen3_5ForCausalLM; the LM head is the (tied) embedding."""

    def __init__(self, cfg: dict, chunk: int = 64) -> None:
        super().__init__()
        if not cfg.get("tie_word_embeddings"):
            raise ValueError("training expects tie_word_embeddings = true")
        self.cfg, self.model = cfg, TextModel(cfg, chunk)
        self._init_weights()

    def _init_weights(self) -> None:
        std, residual_std = self.cfg["initializer_range"], self.cfg["initializer_range"] / math.sqrt(2 * len(self.model.layers))
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=residual_std)
            elif p.ndim == 2:
                nn.init.normal_(p, std=std)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = rope_tables(self.cfg, input_ids.shape[1], input_ids.device)
        for layer in self.model.layers:
            x = layer(x, rope)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.embed_tokens.weight.to(hidden.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V]; with `positions` (flat b * T + t) only there: the supervised ones."""
        hidden = self.hidden_states(input_ids)
        if positions is None:
            return self.logits(hidden)
        return self.logits(hidden.reshape(-1, hidden.shape[-1])[positions])
