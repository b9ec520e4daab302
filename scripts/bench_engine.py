"""Engine-core speed on one GPU: prefill tokens/s and decode tokens/s, hypic against transformers.

Both run the same random bf16 weights (built on the GPU from a seed, in the checkpoint's own
naming) of a released shape (default: the Qwen3.5-35B-A3B text model; nemotron3_nano is Nemotron 3
Nano 30B-A3B, granite4_h_small Granite-4.0-H-Small, kimi_linear_48b Kimi-Linear-48B-A3B: ~96 GB of
weights, so --skip-transformers). Prints each figure as it is measured and a table at the end; writes
JSON under bench/results/ after each figure (hypic.bench.report's ResultFile): a run of some lengths
or batches (`--lengths ''` measures no prefill, `--batches ''` no decode) merges into an existing file
of the same shape and setup, so the figures of a large shape can be measured in several short calls
(docs/benchmarks.md has the plan for kimi_linear_48b).

    python scripts/bench_engine.py
    python scripts/bench_engine.py --shape nemotron3_nano --skip-transformers
    python scripts/bench_engine.py --shape kimi_linear_48b --skip-transformers --lengths 4096 --batches ''
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hypic import EngineConfig, SamplingParams
from hypic.bench.report import ResultFile
from hypic.engine.llm_engine import LLMEngine
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.setup import BUNDLED_MODEL
from hypic.models.kimi_config import KIMI_MODEL_TYPES, KimiLinearConfig
from hypic.models.mamba2_config import MAMBA2_MODEL_TYPES, Mamba2HybridConfig
from hypic.models.random_weights import random_state_dict
from hypic.models.registry import architecture
from results import by_number, device_label, group, grouped_result, int_list, phase, result_path, say

H200_BF16_FLOPS = 790e12  # measured dense bf16 matmul rate on this workplace's H200 (KINDS.md)
H200_HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak bandwidth (NVIDIA's figure)
WARM_UP_TOKENS = 2048  # an unmeasured prefill first: kernels compile and autotune
SHAPES = ("qwen3_5_moe", "qwen3_5", "qwen3_next", "nemotron3_nano", "granite4_h_small", "kimi_linear_48b")

# Released configs' fields, built through transformers' config classes (their defaults fill the rest).
# Nemotron 3 Nano 30B-A3B as issue 24 gives it; Granite-4.0-H-Small from its config.json (4 attention
# layers of 40; its Mamba2 heads 128 x 64 and one group are transformers' defaults, taken as the release's).
HF_SHAPES = {
    "nemotron3_nano": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=131072, hidden_size=2688, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, expand=2, n_routed_experts=128,
        num_experts_per_tok=6, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
        mlp_hidden_act="relu2", routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1,
        intermediate_size=1856)),
    "granite4_h_small": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=100352, hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)], num_local_experts=72,
        num_experts_per_tok=10, intermediate_size=768, shared_intermediate_size=1536, mamba_n_heads=128,
        mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        tie_word_embeddings=True)),
    # Kimi-Linear-48B-A3B as issue 27 gives it: MLA at 1-based layers 4, 8, ..., 24, 27, KDA elsewhere
    "kimi_linear_48b": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_local_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024, n_shared_experts=1,
        intermediate_size=9216, first_k_dense_replace=1, routed_scaling_factor=2.446, n_group=1, topk_group=1,
        linear_attn_config={"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                            "short_conv_kernel_size": 4,
                            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]})),
}


def shape_config(name: str, max_len: int) -> dict:
    import transformers as tf
    if name in HF_SHAPES:
        config_cls, arch, fields = HF_SHAPES[name]
        config = getattr(tf, config_cls)(max_position_embeddings=max_len, **fields).to_dict()
        config["architectures"] = [arch]
        return config
    configs = {"qwen3_5_moe": tf.Qwen3_5MoeTextConfig, "qwen3_5": tf.Qwen3_5TextConfig,
               "qwen3_next": tf.Qwen3NextConfig}
    config = configs[name](max_position_embeddings=max_len).to_dict()
    config["architectures"] = [{"qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                                "qwen3_next": "Qwen3NextForCausalLM"}[name]]
    return config


def parsed_config(config: dict):
    """hypic's parsed config of a shape (HybridConfig or Mamba2HybridConfig)."""
    return architecture(config).config_cls.from_dict(config)


def model_dir(config: dict) -> Path:
    path = Path(tempfile.mkdtemp(prefix="hypic-bench-"))
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return path


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of the shape, random, bf16, on the GPU (transformers' names)."""
    return random_state_dict(parsed_config(config), device=torch.device("cuda"), dtype=torch.bfloat16, seed=seed)


def flops_per_token(c: dict, context: int) -> float:
    """Matmul FLOPs of one prefill token (active parameters) plus attention over `context / 2` keys."""
    if c["model_type"] in MAMBA2_MODEL_TYPES:
        return mamba2_flops_per_token(parsed_config(c), context)
    if c["model_type"] in KIMI_MODEL_TYPES:
        return kimi_flops_per_token(parsed_config(c), context)
    h, layers = c["hidden_size"], c["layer_types"]
    attn_proj = h * c["num_attention_heads"] * c["head_dim"] * 3 + 2 * h * c["num_key_value_heads"] * c["head_dim"]
    k, v = c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
    lin_proj = h * (2 * k + v) + h * v + 2 * h * c["linear_num_value_heads"] + v * h
    gdn = 6 * c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    if "num_experts" in c:
        mlp = 3 * h * c["moe_intermediate_size"] * c["num_experts_per_tok"] + 3 * h * c["shared_expert_intermediate_size"] + h * c["num_experts"]
    else:
        mlp = 3 * h * c["intermediate_size"]
    attn_scores = 2 * c["num_attention_heads"] * c["head_dim"] * context / 2
    per_layer = [(attn_proj + mlp) * 2 + 2 * attn_scores if t == "full_attention" else (lin_proj + mlp) * 2 + gdn
                 for t in layers]
    return float(sum(per_layer))


def mamba2_flops_per_token(c: Mamba2HybridConfig, context: int) -> float:
    """The same count per residual block: projections, the SSD recurrence (state write and read, and
    the chunk's masked products, ~6 H N P as for GDN), attention scores, active experts and router."""
    h = c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    mlp_mats = 2 if c.mlp_act == "relu2" else 3
    shared = c.shared_intermediate_size if c.router == "sigmoid_grouped" else c.intermediate_size
    per_block = {
        "mamba": 2 * h * (c.mamba_intermediate + c.mamba_conv_dim + c.mamba_num_heads) + 2 * c.mamba_intermediate * h
        + 6 * c.mamba_num_heads * c.ssm_state_size * c.mamba_head_dim,
        "attention": 2 * (2 * h * q + 2 * h * kv) + 2 * 2 * q * context / 2,
        "mlp": 2 * mlp_mats * h * c.intermediate_size,
        "moe": 2 * mlp_mats * h * (c.moe_intermediate_size * c.num_experts_per_tok + shared) + 2 * h * c.num_experts}
    return float(sum(per_block[b] for b in c.blocks))


def kimi_flops_per_token(c: KimiLinearConfig, context: int) -> float:
    """Per layer: KDA projections (q, k, v, b, the low-rank gates, o) and the delta rule (~6 H K V), or
    MLA projections and scores over `context / 2` latent keys as prefill expands them; the dense MLP
    or the active and shared experts and the router."""
    h, heads = c.hidden_size, c.num_attention_heads
    qkv = c.linear_num_heads * c.linear_head_dim
    kda = 2 * h * (3 * qkv + c.linear_num_heads + 2 * c.linear_head_dim) + 2 * 2 * c.linear_head_dim * qkv \
        + 2 * qkv * h + 6 * c.linear_num_heads * c.linear_head_dim ** 2
    kv_up = heads * (c.qk_nope_head_dim + c.v_head_dim)
    mla = 2 * h * (heads * c.qk_head_dim + c.latent_dim) + 2 * c.kv_lora_rank * kv_up + 2 * heads * c.v_head_dim * h \
        + 2 * heads * (c.qk_head_dim + c.v_head_dim) * context / 2
    moe = 2 * 3 * h * c.moe_intermediate_size * (c.num_experts_per_tok + c.num_shared_experts) + 2 * h * c.num_experts
    return float(sum((kda if t == "linear_attention" else mla) + (moe if i in c.moe_layers else 6 * h * c.intermediate_size)
                     for i, t in enumerate(c.layer_types)))


def decode_floor(weights: dict, config: dict, batch: int, state_bytes: int, kv_bytes: int) -> float:
    """Decode tokens/s if a step only read what it must at H200 bandwidth: the dense weights, the
    experts that `batch` tokens touch (expected count under uniform routing), every sequence's state
    and KV; a ceiling to compare against."""
    parsed = parsed_config(config)
    experts, top_k = parsed.num_experts, parsed.num_experts_per_tok
    expert_bytes = sum(w.numel() * w.element_size() for n, w in weights.items() if ".experts." in n)
    dense_bytes = sum(w.numel() * w.element_size() for w in weights.values()) - expert_bytes
    touched = 1.0 - (1.0 - top_k / experts) ** batch if experts else 0.0
    step_bytes = dense_bytes + expert_bytes * touched + batch * (state_bytes + kv_bytes)
    return batch * H200_HBM_BYTES_PER_S / step_bytes


def hypic_prefill(engine: LLMEngine, n: int, region=contextlib.nullcontext()) -> float:
    """Seconds of an n-token prefill (inside `region`, e.g. a profiler)."""
    ids = torch.randint(3, 3000, (n,)).tolist()
    prompt = SegmentedPrompt.build(engine.tokenizer, ids, separator="<|segment|>")
    torch.cuda.synchronize()
    with region:
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=str(time.time()))
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start


def hypic_decode(engine: LLMEngine, batch: int, steps: int, region=contextlib.nullcontext()) -> float:
    """Tokens/s of `steps` decode steps at `batch` (inside `region`, e.g. a profiler, their prefill outside)."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        ids = torch.randint(3, 3000, (128,)).tolist()
        engine.add_request(SegmentedPrompt.build(engine.tokenizer, ids, separator="<|segment|>"), params,
                           cache_mode="none")
    while any(not s.in_decode for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    with region:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return batch * steps / elapsed


def bench_hypic(record: ResultFile, path: Path, weights: dict, args: argparse.Namespace) -> None:
    """hypic's prefill figure of each length and decode figure (with its bandwidth floor) of each batch."""
    engine = started_engine(path, weights, args)
    for n in args.lengths:
        with group(record, f"hypic prefill {n}") as saved:
            hypic_prefill(engine, n)
            saved[("hypic", "prefill", str(n))] = tps = n / min(hypic_prefill(engine, n) for _ in range(2))
            say(f"hypic prefill {n}: {tps:.0f} tok/s")
    shape = engine.model.cache_shape()
    state_bytes, kv_bytes = shape.slot_bytes(engine.dtype), shape.page_bytes(1, engine.dtype) * (128 + args.steps)
    for b in args.batches:
        with group(record, f"hypic decode {b}") as saved:
            tps, floor = hypic_decode(engine, b, args.steps), decode_floor(weights, args.config, b, state_bytes, kv_bytes)
            saved[("hypic", "decode", str(b))], saved[("hypic", "decode_floor", str(b))] = tps, floor
            say(f"hypic decode batch {b}: {tps:.0f} tok/s (bandwidth floor {floor:.0f} tok/s)")
    if args.profile:
        profile_hypic(engine, args)


def started_engine(path: Path, weights: dict, args: argparse.Namespace) -> LLMEngine:
    """The engine, sized for this run's lengths and batches, after an unmeasured prefill."""
    config = EngineConfig(model=str(path), device="cuda", state_dict=weights,
                          max_model_len=max([*args.lengths, WARM_UP_TOKENS]) + 64,
                          max_num_seqs=max(args.batches, default=1), max_num_batched_tokens=args.chunk,
                          gpu_memory_utilization=0.92, cache_mode="none", enforce_eager=args.enforce_eager)
    with phase("engine start"):
        engine = LLMEngine(config)
    graphs = engine.runner.graphs
    say(f"hypic engine: {engine.plan}, decode graphs for {graphs.sizes if graphs else None}")
    with phase("warm-up"):
        hypic_prefill(engine, WARM_UP_TOKENS)
    return engine


def profile_hypic(engine: LLMEngine, args: argparse.Namespace) -> None:
    """Top GPU kernels of one prefill (the largest length up to 16k, if any) and of 4 decode steps at each batch."""
    from torch.profiler import ProfilerActivity, profile
    prefills = [n for n in args.lengths if n <= 16384][-1:]
    works = [(f"prefill {n}", functools.partial(hypic_prefill, engine, n)) for n in prefills] + [
        (f"decode batch {b}, 4 steps", functools.partial(hypic_decode, engine, b, 4)) for b in args.batches]
    for name, work in works:
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        work(region=prof)  # the timed steps alone (a decode's prompts' prefill outside)
        print(f"---- profile: hypic {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)


def bench_transformers(record: ResultFile, config: dict, weights: dict, args: argparse.Namespace) -> None:
    import transformers as tf
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**config), dtype=torch.bfloat16)
    model.load_state_dict(weights, strict=True, assign=True)  # the same tensors as hypic's: no second copy
    _rebuild_rotary(model)
    model = model.cuda().eval()
    with torch.inference_mode():
        with phase("transformers warm-up"):
            _hf_prefill(model, WARM_UP_TOKENS)
        for n in args.hf_lengths:
            with group(record, f"transformers prefill {n}") as saved:
                saved[("transformers", "prefill", str(n))] = tps = n / min(_hf_prefill(model, n) for _ in range(2))
                say(f"transformers prefill {n}: {tps:.0f} tok/s")
        for b in args.batches:
            with group(record, f"transformers decode {b}") as saved:
                saved[("transformers", "decode", str(b))] = tps = _hf_decode(model, b, max(4, args.steps // 4))
                say(f"transformers decode batch {b}: {tps:.0f} tok/s")
    del model


def _rebuild_rotary(model) -> None:
    """Built on meta, the rotary embedding's inv_freq buffers (not in the state dict) have no data:
    make the module again on the GPU from the config."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:  # NoPE models (Nemotron-H)
        return
    with torch.device("cuda"):
        model.model.rotary_emb = type(rotary)(model.config)


def _hf_prefill(model, n: int) -> float:
    ids = torch.randint(3, 3000, (1, n), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _hf_decode(model, batch: int, steps: int) -> float:
    ids = torch.randint(3, 3000, (batch, 128), device="cuda")
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(2):  # warm-up: the first decode steps compile and autotune FLA's recurrent kernel
        cache, token = _hf_step(model, cache, token)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        cache, token = _hf_step(model, cache, token)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


def _hf_step(model, cache, token: torch.Tensor):
    out = model(input_ids=token, past_key_values=cache, use_cache=True)
    return out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3_5_moe", choices=SHAPES)
    parser.add_argument("--lengths", type=int_list, default=[4096, 16384, 65536], help="hypic prefill lengths")
    parser.add_argument("--hf-lengths", type=int_list, default=[4096, 16384, 32768])
    parser.add_argument("--batches", type=int_list, default=[1, 32, 128], help="decode batches (both engines)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top kernels of hypic")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for hypic's decode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default: bench/results/engine_<device>_<shape>.json")
    args = parser.parse_args(argv)
    args.out = args.out or result_path("engine", device_label(torch.cuda.get_device_name()), args.shape)
    return args


def requested_groups(args: argparse.Namespace) -> list[str]:
    hypic = [f"hypic prefill {n}" for n in args.lengths] + [f"hypic decode {b}" for b in args.batches]
    hf = [f"transformers prefill {n}" for n in args.hf_lengths] + [f"transformers decode {b}" for b in args.batches]
    return ["weights", *hypic, *([] if args.skip_transformers else hf)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = shape_config(args.shape, max(max(args.lengths, default=0) + 64, 32768))
    args.config = config
    header = {"benchmark": "engine", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": args.shape, "chunk": args.chunk, "cuda_graphs": not args.enforce_eager, "steps": args.steps}
    record = grouped_result(args.out, header, requested_groups(args), finish=functools.partial(derive, config))
    with group(record, "weights") as saved:
        weights = random_weights(config, args.seed)
        saved[("params_b",)] = sum(w.numel() for w in weights.values()) / 1e9
    bench_hypic(record, model_dir(config), weights, args)  # saved figure by figure: they survive a later failure
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_transformers:
        bench_transformers(record, config, weights, args)
    report(record.data)


def derive(config: dict, data: dict) -> None:
    """From the merged raw figures: each prefill's fraction of the bf16 peak, hypic over transformers."""
    hypic, hf = data.setdefault("hypic", {}), data.get("transformers", {})
    for kind in ("prefill", "decode", "decode_floor"):
        hypic[kind] = by_number(hypic.get(kind, {}))
    data["prefill_fraction_of_bf16_peak"] = {
        n: tps * flops_per_token(config, int(n)) / H200_BF16_FLOPS for n, tps in hypic["prefill"].items()}
    if hf:
        data["speedup_over_transformers"] = {kind: {k: hypic[kind][k] / v for k, v in by_number(hf.get(kind, {})).items()
                                                    if k in hypic[kind]} for kind in ("prefill", "decode")}


def report(result: dict) -> None:
    """Every figure the file holds (this run's and earlier runs')."""
    hf = result.get("transformers", {})
    hypic, speedup = result["hypic"], result.get("speedup_over_transformers", {})
    say(f"{result['device']}  {result['shape']}  {result['params_b']:.1f} B params")
    for n, tps in hypic["prefill"].items():
        ratio = f"{speedup['prefill'][n]:.2f}x" if n in speedup.get("prefill", {}) else "-"
        say(f"prefill {n:>6}: hypic {tps:>9.0f} tok/s  transformers {hf.get('prefill', {}).get(n, 0):>9.0f}  {ratio}  "
            f"({result['prefill_fraction_of_bf16_peak'][n]:.1%} of bf16 peak)")
    for b, tps in hypic["decode"].items():
        ratio = f"{speedup['decode'][b]:.1f}x" if b in speedup.get("decode", {}) else "-"
        floor = f"  ({tps / hypic['decode_floor'][b]:.0%} of the bandwidth floor)" if b in hypic["decode_floor"] else ""
        say(f"decode batch {b:>3}: hypic {tps:>8.0f} tok/s  transformers {hf.get('decode', {}).get(b, 0):>8.0f}  "
            f"{ratio}{floor}")


if __name__ == "__main__":
    main()
