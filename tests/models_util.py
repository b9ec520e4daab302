"""Model-test helpers: tiny transformers checkpoints carrying the known traps, and hand-built batches.

Traps in every tiny config: linear key head dim (8) != value head dim (12), HV / H = 3, vocabulary padded
past the "tokenizer" (320 rows, ids drawn below TOKENIZER_VOCAB), partial RoPE (half the head dim), GQA;
qwen3_next alternates dense and MoE MLPs (decoder_sparse_step=2 and mlp_only_layers=[5]: MoE on 1 and 3).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hypic.cache.model_caches import ModelCaches
from hypic.models.batch import ForwardBatch
from hypic.models.config import HybridConfig
from hypic.models.kimi_config import KimiLinearConfig
from hypic.models.mamba2_config import Mamba2HybridConfig
from hypic.models.random_weights import slow_decay  # noqa: F401 (the tests' name for it)
from hypic.models.registry import MODEL_REGISTRY, load_model

TOKENIZER_VOCAB = 300  # ids the tests feed; the model's vocab_size (320) is padded past it

TEXT_CONFIG = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
    linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.08,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention",
                 "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    eos_token_id=299,
)
MOE_CONFIG = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                     num_position_embeddings=16)


def make_hf_model(kind: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random transformers causal LM, float32, eval mode. `kind`: qwen3_next, qwen3_5_text,
    qwen3_5_moe_text or qwen3_5 (multimodal: the text model above a one-block vision tower)."""
    import transformers as tf

    torch.manual_seed(seed)
    text = {**TEXT_CONFIG, **overrides}
    if kind == "qwen3_next":
        config = tf.Qwen3NextConfig(**text, intermediate_size=96, decoder_sparse_step=2, mlp_only_layers=[5],
                                    **MOE_CONFIG)
        model = tf.Qwen3NextForCausalLM(config)
    elif kind == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text, intermediate_size=96))
    elif kind == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text, **MOE_CONFIG))
    elif kind == "qwen3_5":
        config = tf.Qwen3_5Config(text_config={**text, "intermediate_size": 96}, vision_config=VISION_CONFIG)
        model = tf.Qwen3_5ForConditionalGeneration(config)
    else:
        raise ValueError(kind)
    _perturb_defaults(model)
    return model.eval()


def _perturb_defaults(model: torch.nn.Module) -> None:
    """Norm weights start at 0 (or 1) and dt_bias at 1: move them so a wrong offset convention shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                param.add_(torch.randn_like(param) * 0.3)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, vocab] of one sequence, from scratch."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def save_checkpoint(model: torch.nn.Module, path: Path, *, max_shard_size: str | None = None,
                    rewrite: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> Path:
    """save_pretrained into path (sharded when max_shard_size is given); `rewrite` edits the tensors and
    writes them back as one model.safetensors."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if rewrite is not None:
        tensors = rewrite(read_checkpoint(path))
        for file in list(path.glob("*.safetensors")) + list(path.glob("*.index.json")):
            file.unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def add_mtp_and_vision(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What released checkpoints carry besides the text model: MTP heads and (fake) vision weights."""
    extra = {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.randn(64),
             "mtp.norm.weight": torch.randn(64), "model.visual.patch_embed.proj.weight": torch.randn(8, 3, 2, 4, 4)}
    return {**tensors, **extra}


def fuse_experts(tensors: dict[str, torch.Tensor], transposed: bool = False) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down -> fused experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]
    (or [E, H, 2I] / [E, I, H] when transposed)."""
    out, groups = {}, {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
            continue
        prefix, rest = name.split(".mlp.experts.")
        expert, proj = rest.split(".")[:2]
        groups.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = tensor
    for prefix, projs in groups.items():
        stack = {p: torch.stack([w[e] for e in sorted(w)]) for p, w in projs.items()}
        gate_up, down = torch.cat((stack["gate_proj"], stack["up_proj"]), dim=1), stack["down_proj"]
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[f"{prefix}.mlp.experts.gate_up_proj"], out[f"{prefix}.mlp.experts.down_proj"] = gate_up, down
    return out


# ---- hand-built batches ------------------------------------------------------------------------------

@dataclass
class Seq:
    """One sequence's private cache: its state slot, its KV pages and how many tokens they hold."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class BatchBuilder:
    """Caches for one model plus a trivial page allocator. Slots and pages start full of junk so that a
    fresh sequence (has_state False) that read them would show."""

    def __init__(self, config: HybridConfig | Mamba2HybridConfig | KimiLinearConfig, *, block_size: int = 4, num_blocks: int = 96, num_slots: int = 8,
                 dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")) -> None:
        self.block_size, self.device = block_size, device
        model_cls = MODEL_REGISTRY[config.model_type].model_cls
        with torch.device("meta"):
            shape = model_cls(config).cache_shape()
        self.caches = ModelCaches(shape, num_blocks, block_size, num_slots, dtype, device)
        for i in config.linear_layers:
            for pool in self.caches.state(i):
                pool.normal_(0.0, 3.0)
        for i in config.full_layers:
            for pages in self.caches.kv(i):
                pages.normal_(0.0, 3.0)
        self._free_blocks = list(range(num_blocks - 1, 0, -1))  # reversed so pages are not in order

    def new_seq(self, slot: int) -> Seq:
        return Seq(slot=slot)

    def batch(self, pieces: list[tuple[Seq, list[int]]]) -> ForwardBatch:
        """One step over (sequence, this step's tokens) pairs, in order; decodes must come first.
        A decode is a 1-token piece of a sequence that already holds tokens. Every token's logits return."""
        num_decodes = next((i for i, (s, t) in enumerate(pieces) if not (len(t) == 1 and s.length)), len(pieces))
        positions, write_slots, has_state, kv_lens = [], [], [], []
        for seq, tokens in pieces:
            has_state.append(seq.length > 0)
            positions += self._place(seq, len(tokens), write_slots)
            kv_lens.append(seq.length)
        lens = [len(t) for _, t in pieces]
        width = max(len(s.blocks) for s, _ in pieces)
        tables = [s.blocks + [0] * (width - len(s.blocks)) for s, _ in pieces]
        on = {"device": self.device}
        return ForwardBatch(
            input_ids=torch.tensor([i for _, t in pieces for i in t], **on), positions=torch.tensor(positions, **on),
            cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, **on),
            slots=torch.tensor([s.slot for s, _ in pieces], **on), has_state=torch.tensor(has_state, **on),
            block_tables=torch.tensor(tables, dtype=torch.int32, **on),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, **on), kv_write_slots=torch.tensor(write_slots, **on),
            logits_indices=torch.arange(sum(lens), **on), num_decodes=num_decodes, seq_lens_cpu=tuple(lens),
            kv_lens_cpu=tuple(kv_lens), max_kv_len=max(kv_lens))

    def _place(self, seq: Seq, n: int, write_slots: list[int]) -> list[int]:
        positions = list(range(seq.length, seq.length + n))
        while len(seq.blocks) * self.block_size < seq.length + n:
            seq.blocks.append(self._free_blocks.pop())
        write_slots += [seq.blocks[p // self.block_size] * self.block_size + p % self.block_size for p in positions]
        seq.length += n
        return positions


def run(model: torch.nn.Module, builder: BatchBuilder, pieces: list[tuple[Seq, list[int]]]) -> torch.Tensor:
    """Logits [N, vocab] of every token of one step."""
    batch = builder.batch(pieces)
    return model.compute_logits(model(batch, builder.caches))


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, TOKENIZER_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def assert_decode_replays(model: torch.nn.Module, builder: BatchBuilder, batch: ForwardBatch) -> None:
    """A decode step captured in a CUDA graph and replayed from the same caches gives the eager step's
    hidden states."""
    config, caches = model.config, builder.caches
    tensors = [t for i in config.full_layers for t in caches.kv(i)]
    tensors += [t for i in config.linear_layers for t in caches.state(i)]
    saved = [t.clone() for t in tensors]

    def restore() -> None:
        for t, s in zip(tensors, saved):
            t.copy_(s)

    eager = model(batch, caches).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        restore()
        model(batch, caches)  # warm-up (Triton compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(batch, caches)
    restore()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=1e-3, atol=1e-3)


def mixed_steps_logits(model: torch.nn.Module, device: torch.device, dtype: torch.dtype
                       ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Two fresh prefills, then a decode beside a continued prefill and a third fresh one, then decodes
    of two: the prompts and each sequence's logits over the steps (150, 64 and 33 tokens, on the CPU)."""
    builder = BatchBuilder(model.config, block_size=16, num_blocks=64, num_slots=8, dtype=dtype, device=device)
    prompts = [random_ids(n, seed=n) for n in (150, 70, 33)]
    seqs = [builder.new_seq(slot=s) for s in (5, 1, 7)]
    logits: list[list[torch.Tensor]] = [[], [], []]
    steps = [[(seqs[0], prompts[0][:100]), (seqs[1], prompts[1][:60])],
             [(seqs[1], prompts[1][60:61]), (seqs[0], prompts[0][100:]), (seqs[2], prompts[2][:30])]]
    steps += [[(seqs[b], prompts[b][n:n + 1]) for b, n in ((1, 61 + i), (2, 30 + i))] for i in range(3)]
    for pieces in steps:
        out, start = run(model, builder, pieces).float().cpu(), 0
        for seq, tokens in pieces:
            logits[seqs.index(seq)].append(out[start:start + len(tokens)])
            start += len(tokens)
    return prompts, [torch.cat(per_seq) for per_seq in logits]


def assert_greedy_decode_tracks_full_forward(model: torch.nn.Module, hf: torch.nn.Module, steps: int) -> None:
    """Prefill, then one token a step: every step's logits are transformers' full forward's last row
    and the greedy tokens are the same."""
    builder = BatchBuilder(model.config)
    seq, ids = builder.new_seq(slot=3), random_ids(12, seed=2)
    logits = run(model, builder, [(seq, ids)])[-1]
    for _ in range(steps):
        expected = hf_logits(hf, ids)[-1]
        assert rel_err(logits, expected) < 1e-4 and int(logits.argmax()) == int(expected.argmax())
        ids = ids + [int(logits.argmax())]
        logits = run(model, builder, [(seq, ids[-1:])])[0]


def assert_chunks_beside_other_sequences_change_nothing(model: torch.nn.Module) -> None:
    """One prompt prefilled in three chunks beside another sequence's decodes and a third's prefill
    gives the logits of one whole-prompt forward."""
    builder = BatchBuilder(model.config)
    ids, other, third = random_ids(40, seed=5), random_ids(9, seed=6), random_ids(11, seed=7)
    alone = run(model, builder, [(builder.new_seq(slot=0), ids)])
    seq, neighbour = builder.new_seq(slot=1), builder.new_seq(slot=2)
    run(model, builder, [(neighbour, other)])
    pieces = []
    for start, end in ((0, 7), (7, 29), (29, 40)):
        step = run(model, builder, [(neighbour, [other[start % 9]]), (seq, ids[start:end]),
                                    (builder.new_seq(slot=4 + start % 3), third)])
        pieces.append(step[1:1 + end - start])
    assert rel_err(torch.cat(pieces), alone) < 1e-5


def assert_cuda_matches_cpu(checkpoint: Path, dtype: torch.dtype, tolerance: float) -> None:
    """mixed_steps_logits on CUDA in `dtype` against the CPU in float32, on the same weights."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    _, expected = mixed_steps_logits(load_model(str(checkpoint), device=cpu, dtype=torch.float32), cpu, torch.float32)
    _, actual = mixed_steps_logits(load_model(str(checkpoint), device=cuda, dtype=dtype), cuda, dtype)
    for b, (got, want) in enumerate(zip(actual, expected)):
        assert rel_err(got, want) < tolerance, f"sequence {b}"


def assert_cuda_graph_decode_replays(checkpoint: Path) -> None:
    """Three sequences prefilled on CUDA in bfloat16, then their decode step replayed from a CUDA graph."""
    cuda = torch.device("cuda")
    model = load_model(str(checkpoint), device=cuda, dtype=torch.bfloat16)
    builder = BatchBuilder(model.config, block_size=16, num_blocks=32, num_slots=8, dtype=torch.bfloat16,
                           device=cuda)
    seqs = [builder.new_seq(slot=s) for s in (2, 6, 3)]
    run(model, builder, [(seq, random_ids(20 + 9 * i, seed=i)) for i, seq in enumerate(seqs)])
    assert_decode_replays(model, builder, builder.batch([(seq, [7 + i]) for i, seq in enumerate(seqs)]))


TORCH_CODE = str(Path(torch.__file__).parent)
MODEL_CODE = str(Path(__file__).resolve().parents[1] / "hypic" / "models")
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__bool__, torch.Tensor.__index__}


class HostReadGuard(torch.Tensor):
    """A tensor that raises when model code (hypic/models) turns it, or anything computed from it, into
    Python values: on a GPU that is a device->host sync, and inside a CUDA-graph capture an error. The
    CPU references under hypic/kernels read their inputs on the host freely (they never run on a GPU)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS and _caller_file().startswith(MODEL_CODE):
            raise AssertionError(f"model code reads a device tensor on the host ({func.__name__})")
        return super().__torch_function__(func, types, args, kwargs or {})


def _caller_file() -> str:
    """The file of the first frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith((TORCH_CODE, __file__)):
        frame = frame.f_back
    return frame.f_code.co_filename


def guarded(batch: ForwardBatch) -> ForwardBatch:
    """The batch with its tensors guarded against host reads by model code (see `HostReadGuard`)."""
    tensors = {f.name: getattr(batch, f.name).as_subclass(HostReadGuard) for f in fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **tensors)


# transformers binds FLA's kernels whenever FLA imports, CPU tensors or not (they then fail): its CPU
# reference runs in a child process where FLA cannot import, so it takes its own torch code path.
TORCH_ONLY_LOGITS = """
import sys
sys.modules["fla"] = None
import torch, transformers
path, file = sys.argv[1], sys.argv[2]
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with torch.no_grad():
    logits = [model(input_ids=torch.tensor([ids])).logits[0].float() for ids in torch.load(file)]
torch.save(logits, file)
"""


def hf_torch_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 CPU logits [T, vocab] of each prompt, from scratch, FLA hidden."""
    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch) / "prompts.pt"
        torch.save(prompts, file)
        subprocess.run([sys.executable, "-c", TORCH_ONLY_LOGITS, str(path), str(file)], check=True)
        return torch.load(file)
