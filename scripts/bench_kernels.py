"""Times each GPU kernel of hypic.kernels at a released model's shapes and compares it with the roofline.

For every case: median time (triton.testing.do_bench), the fewest bytes the kernel must move and
the FLOPs it must do, and the fractions of this machine's ceilings they reach. Prints a table and
writes JSON. Shapes: Qwen3.5-35B-A3B (default: GDN, conv, paged attention, MoE, and a GDN layer's
tuple capture, the chunk-factor product against the chunk kernel's pass) and Nemotron 3 Nano
(`--shape nemotron3_nano`: a Mamba2 layer's tuple capture, the chunk kernel's pass against the
closed form).

    python scripts/bench_kernels.py [--shape nemotron3_nano]
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hypic.kernels.conv1d import causal_conv1d
from hypic.kernels.gdn import gated_delta_rule
from hypic.kernels.gdn_tuples import gdn_span_tuples
from hypic.kernels.linear_families import DenseFamily, get_family
from hypic.kernels.moe import moe_grouped_mm, moe_triton
from hypic.kernels.paged_attention import paged_attention
from hypic.kernels.scalar_gated import scalar_gated_rule
from hypic.kernels.span_states import span_tuples
from hypic.kernels.varlen import Operands, RowSpans
from results import device_label, result_path, run_record

HBM_BYTES_PER_S = 4.3e12  # device-to-device copy measured on this workplace's H200 (KINDS.md)
BF16_FLOPS = 790e12  # dense bf16 matmul measured there

# Qwen3.5-35B-A3B
LIN_HEADS, LIN_VALUE_HEADS, LIN_DIM, CONV_WIDTH = 16, 32, 128, 4
CONV_DIM = 2 * LIN_HEADS * LIN_DIM + LIN_VALUE_HEADS * LIN_DIM
ATTN_HEADS, ATTN_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 2, 256, 16
EXPERTS, TOPK, HIDDEN, EXPERT_INTER = 256, 8, 2048, 512
DTYPE = torch.bfloat16

# Nemotron 3 Nano 30B-A3B's Mamba2 layers: B per group is the key head, dt x the values
MAMBA_GROUPS, MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE = 8, 64, 64, 128


@dataclass(frozen=True)
class Case:
    kernel: str
    shape: str
    run: Callable[[], object]
    bytes: float  # fewest bytes moved through device memory
    flops: float


@dataclass(frozen=True)
class Result:
    kernel: str
    shape: str
    ms: float
    gb_per_s: float
    tflop_per_s: float
    bandwidth_fraction: float
    flop_fraction: float
    bound: str  # the larger of the two roofline floors


def measure(case: Case) -> Result:
    from triton.testing import do_bench

    ms = do_bench(case.run, warmup=25, rep=100, return_mode="median")
    seconds = ms * 1e-3
    byte_floor, flop_floor = case.bytes / HBM_BYTES_PER_S, case.flops / BF16_FLOPS
    return Result(case.kernel, case.shape, ms, case.bytes / seconds / 1e9, case.flops / seconds / 1e12,
                  byte_floor / seconds, flop_floor / seconds, "memory" if byte_floor >= flop_floor else "compute")


# ----------------------------------------------------------------------------- batches

def varlen(seq_lens: tuple[int, ...], num_decodes: int, num_slots: int) -> dict:
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return dict(slots=torch.randperm(num_slots, device="cuda")[: len(seq_lens)],
                has_state=torch.ones(len(seq_lens), dtype=torch.bool, device="cuda"), cu_seqlens=cu,
                num_decodes=num_decodes, seq_lens_cpu=seq_lens)


def gdn_case(seq_lens: tuple[int, ...], num_decodes: int) -> Case:
    n, b = sum(seq_lens), len(seq_lens)
    q = F.normalize(torch.randn(n, LIN_HEADS, LIN_DIM, device="cuda"), dim=-1).to(DTYPE)
    k = F.normalize(torch.randn(n, LIN_HEADS, LIN_DIM, device="cuda"), dim=-1).to(DTYPE)
    v = torch.randn(n, LIN_VALUE_HEADS, LIN_DIM, device="cuda", dtype=DTYPE)
    g = F.logsigmoid(torch.randn(n, LIN_VALUE_HEADS, device="cuda"))
    beta = torch.rand(n, LIN_VALUE_HEADS, device="cuda", dtype=DTYPE)
    pool = torch.zeros(b + 8, LIN_VALUE_HEADS, LIN_DIM, LIN_DIM, device="cuda")
    batch = varlen(seq_lens, num_decodes, b + 8)
    state = LIN_VALUE_HEADS * LIN_DIM * LIN_DIM * 4
    io = n * (2 * LIN_HEADS * LIN_DIM + 2 * LIN_VALUE_HEADS * LIN_DIM) * 2 + n * LIN_VALUE_HEADS * 6
    # decode: ~6 K*V flops per head and token; chunked prefill: ~6 K*V + 64 * (6K + 4V)
    per_token = 6 * LIN_DIM ** 2 + (0 if num_decodes == b else 64 * 10 * LIN_DIM)
    return Case("gdn " + ("decode (triton)" if num_decodes == b else "prefill (fla)"), shape_name(seq_lens),
                lambda: gated_delta_rule(q, k, v, g, beta, pool, scale=LIN_DIM ** -0.5, **batch),
                2 * b * state + io, n * LIN_VALUE_HEADS * per_token)


def conv_case(seq_lens: tuple[int, ...], num_decodes: int) -> Case:
    n, b = sum(seq_lens), len(seq_lens)
    x = torch.randn(n, CONV_DIM, device="cuda", dtype=DTYPE)
    weight = torch.randn(CONV_DIM, CONV_WIDTH, device="cuda", dtype=DTYPE)
    pool = torch.zeros(b + 8, CONV_DIM, CONV_WIDTH - 1, device="cuda", dtype=DTYPE)
    batch = varlen(seq_lens, num_decodes, b + 8)
    window = CONV_DIM * (CONV_WIDTH - 1) * 2
    return Case("conv1d " + ("decode" if num_decodes == b else "prefill"), shape_name(seq_lens),
                lambda: causal_conv1d(x, weight, None, pool, activation="silu", **batch),
                2 * n * CONV_DIM * 2 + 2 * b * window, n * CONV_DIM * (2 * CONV_WIDTH + 4))


def attention_case(kv_lens: tuple[int, ...], q_lens: tuple[int, ...]) -> Case:
    b, n = len(kv_lens), sum(q_lens)
    blocks = [-(-kv // BLOCK_SIZE) for kv in kv_lens]
    k_cache = torch.randn(sum(blocks), BLOCK_SIZE, ATTN_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    pages = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)  # shuffled, none shared
    tables = torch.zeros(b, max(blocks), dtype=torch.int32, device="cuda")
    for i, (start, count) in enumerate(zip(itertools.accumulate(blocks, initial=0), blocks)):
        tables[i, :count] = pages[start:start + count]
    positions = torch.cat([torch.arange(kv - t, kv, device="cuda") for kv, t in zip(kv_lens, q_lens)])
    q = torch.randn(n, ATTN_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    num_decodes = sum(1 for t in q_lens if t == 1)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kv_bytes = sum(kv_lens) * ATTN_KV_HEADS * HEAD_DIM * 2 * 2
    pairs = sum(t * kv - t * (t - 1) / 2 for kv, t in zip(kv_lens, q_lens))  # causal (query, key) pairs
    return Case("paged attention " + ("decode" if num_decodes == b else "prefill"),
                f"kv={shape_name(kv_lens)} q={shape_name(q_lens)}",
                lambda: paged_attention(q, k_cache, v_cache, tables, kv_lens_t, positions, cu,
                                        scale=HEAD_DIM ** -0.5, num_decodes=num_decodes, seq_lens_cpu=q_lens,
                                        max_kv_len=max(kv_lens)),
                kv_bytes + 2 * n * ATTN_HEADS * HEAD_DIM * 2, 4 * pairs * ATTN_HEADS * HEAD_DIM)


def moe_case(tokens: int, path: Callable, label: str) -> Case:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
    w_gate_up = torch.randn(EXPERTS, 2 * EXPERT_INTER, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN ** 0.5
    w_down = torch.randn(EXPERTS, HIDDEN, EXPERT_INTER, device="cuda", dtype=DTYPE) / EXPERT_INTER ** 0.5
    weights, ids = torch.randn(tokens, EXPERTS, device="cuda").softmax(-1).topk(TOPK)
    touched = ids.unique().numel()
    weight_bytes = touched * 3 * HIDDEN * EXPERT_INTER * 2
    return Case(f"moe {label}", f"tokens={tokens}", lambda: path(x, w_gate_up, w_down, weights, ids),
                weight_bytes + 2 * tokens * HIDDEN * 2, tokens * TOPK * 6 * HIDDEN * EXPERT_INTER)


def tuple_capture_case(seq_lens: tuple[int, ...], closed_form: bool) -> Case:
    """S0 of cold interiors from zero: the varlen chunk kernel (FLA's chunk_simple_gla, which also
    computes the outputs nobody reads) as `extract_tuple` ran it before, or the closed form."""
    n, b = sum(seq_lens), len(seq_lens)
    k = torch.randn(n, MAMBA_GROUPS, MAMBA_STATE, device="cuda", dtype=DTYPE)
    v = torch.randn(n, MAMBA_HEADS, MAMBA_HEAD_DIM, device="cuda", dtype=DTYPE)
    g = -0.1 * torch.rand(n, MAMBA_HEADS, device="cuda")  # dt A
    batch = varlen(seq_lens, 0, b)
    pool = torch.zeros(b, MAMBA_HEADS, MAMBA_STATE, MAMBA_HEAD_DIM, device="cuda")
    spans = RowSpans.packed(batch["cu_seqlens"], seq_lens)
    run = ((lambda: span_tuples(k, v, g, spans)) if closed_form else
           (lambda: scalar_gated_rule(k, k, v, g, pool, scale=1.0, **batch)))
    io = n * (MAMBA_GROUPS * MAMBA_STATE + MAMBA_HEADS * MAMBA_HEAD_DIM) * 2 + n * MAMBA_HEADS * 4
    return Case("scalar tuple S0 " + ("(closed form)" if closed_form else "(chunk kernel)"), shape_name(seq_lens),
                run, io + b * MAMBA_HEADS * MAMBA_STATE * MAMBA_HEAD_DIM * 4,
                2 * n * MAMBA_HEADS * MAMBA_STATE * MAMBA_HEAD_DIM)


def gdn_tuple_case(seq_lens: tuple[int, ...], product: bool) -> Case:
    """T and S0 of cold GDN interiors: the ordered product of chunk factors (`gdn_span_tuples`), or the
    chunk kernel's pass over [v | 0] from [0 | I] that the capture ran before (`DenseFamily.spans_tuple`)."""
    n, b, chunks = sum(seq_lens), len(seq_lens), sum(-(-length // 64) for length in seq_lens)
    k = F.normalize(torch.randn(n, LIN_HEADS, LIN_DIM, device="cuda"), dim=-1).to(DTYPE)
    x = Operands(k, k, torch.randn(n, LIN_VALUE_HEADS, LIN_DIM, device="cuda", dtype=DTYPE),
                 F.logsigmoid(torch.randn(n, LIN_VALUE_HEADS, device="cuda")),
                 torch.rand(n, LIN_VALUE_HEADS, device="cuda", dtype=DTYPE))
    spans, family = RowSpans.packed(varlen(seq_lens, 0, b)["cu_seqlens"], seq_lens), get_family("gdn")
    run = ((lambda: gdn_span_tuples(x.k, x.v, x.g, x.beta, spans)) if product else
           (lambda: DenseFamily.spans_tuple(family, x, spans)))
    io = n * (LIN_HEADS * LIN_DIM + LIN_VALUE_HEADS * LIN_DIM) * 2 + n * LIN_VALUE_HEADS * 6
    width, c = 2 * LIN_DIM, 64  # [T | S0] columns, tokens a chunk
    per_chunk = 2 * c * c * 3 * LIN_DIM + 2 * c * LIN_DIM * width + 2 * LIN_DIM * LIN_DIM * width  # factors, product
    return Case("gdn tuple " + ("(chunk-factor product)" if product else "(chunk kernel, [v | 0])"),
                shape_name(seq_lens), run, io + b * LIN_VALUE_HEADS * LIN_DIM * width * 4,
                chunks * LIN_VALUE_HEADS * per_chunk)


def shape_name(lens: tuple[int, ...]) -> str:
    return f"{lens[0]}x{len(lens)}" if len(set(lens)) == 1 else "+".join(map(str, lens))


def nemotron_cases() -> Iterator[Callable[[], Case]]:
    for lens in ((2048,) * 8, (1024,) * 16, (4096,) * 4, (65536,)):  # bench_pic's tuple overhead is 8 x 2048
        for closed_form in (False, True):
            yield lambda lens=lens, closed_form=closed_form: tuple_capture_case(lens, closed_form)


def qwen_cases() -> Iterator[Callable[[], Case]]:
    for batch in (1, 32, 128):
        yield lambda batch=batch: gdn_case((1,) * batch, batch)
        yield lambda batch=batch: conv_case((1,) * batch, batch)
        yield lambda batch=batch: attention_case((4096,) * batch, (1,) * batch)
        yield lambda batch=batch: moe_case(batch, moe_grouped_mm, "torch._grouped_mm")
        yield lambda batch=batch: moe_case(batch, moe_triton, "triton")
    yield lambda: attention_case((32768,), (1,))
    for lens in ((4096,), (512,) * 8):
        yield lambda lens=lens: gdn_case(lens, 0)
        yield lambda lens=lens: conv_case(lens, 0)
        yield lambda lens=lens: attention_case(lens, lens)
    yield lambda: attention_case((8192,), (2048,))  # a chunk continuing 6k tokens of paged KV
    for tokens in (4096, 16384):
        yield lambda tokens=tokens: moe_case(tokens, moe_grouped_mm, "torch._grouped_mm")
        yield lambda tokens=tokens: moe_case(tokens, moe_triton, "triton")
    for lens in ((2032,) * 8, (16368,)):  # bench_pic's tuple overhead: 8 interiors of 2048 - 2 x 8 seam tokens
        for product in (False, True):
            yield lambda lens=lens, product=product: gdn_tuple_case(lens, product)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3_5_moe")
    parser.add_argument("--out", type=Path, help="default: bench/results/kernels_<device>_<shape>.json")
    args = parser.parse_args()
    args.out = args.out or result_path("kernels", device_label(torch.cuda.get_device_name()), args.shape)
    torch.manual_seed(0)
    results = []
    print(f"{'kernel':34} {'shape':28} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'%bw':>6} {'%flop':>6}  bound")
    failures: list[str] = []
    for make in SHAPES[args.shape]():
        try:
            result = measure(make())
        except Exception as e:  # one broken kernel must not hide the others' numbers
            failures.append(repr(e))
            print(f"FAILED: {e!r}", flush=True)
            continue
        results.append(result)
        print(f"{result.kernel:34} {result.shape:28} {result.ms:9.4f} {result.gb_per_s:8.0f} "
              f"{result.tflop_per_s:8.1f} {100 * result.bandwidth_fraction:6.1f} {100 * result.flop_fraction:6.1f}"
              f"  {result.bound}", flush=True)
        torch.cuda.empty_cache()
        write_report(args.out, results, failures)  # after every case: a killed run keeps what it measured
    print(f"wrote {args.out}")


SHAPES = {"qwen3_5_moe": qwen_cases, "nemotron3_nano": nemotron_cases}


def write_report(out: Path, results: list[Result], failures: list[str]) -> None:
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=str(DTYPE),
                  hbm_bytes_per_s=HBM_BYTES_PER_S, bf16_flops=BF16_FLOPS,
                  **run_record(), results=[asdict(r) for r in results],
                  failures=failures)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
