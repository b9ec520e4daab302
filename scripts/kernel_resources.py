"""Registers and spills of the PIC walk kernel (or the MLA latent kernel) on sm90, compiled here: no
GPU needed.

A kernel that spills its tiles to the stack runs many times slower than its arithmetic suggests,
and only ptxas knows: this compiles `_compose_recur_kernel` (or `_mla_kernel`) for Hopper with the
local Triton and prints cuobjdump's resource line (REG = registers a thread, STACK = bytes spilled a
thread) and, for MLA, the tensor-core instructions (HGMMA: wgmma; HMMA: mma.sync).

    python scripts/kernel_resources.py                       # Qwen3-Next / Qwen3.5 GDN heads
    python scripts/kernel_resources.py --family scalar --key-dim 64
    python scripts/kernel_resources.py --block-v 16 --num-warps 2   # another launch shape
    python scripts/kernel_resources.py --tuple-dtype bfloat16       # bf16 cached tuples (the bf16 compose)
    python scripts/kernel_resources.py --loops     # and the SASS's loops (a token, a compose step, ...)
    python scripts/kernel_resources.py --mla-tokens 1     # MLA at the 48B shape: decode tiles
    python scripts/kernel_resources.py --mla-tokens 150   # a PIC assembly step's seam tiles
    python scripts/kernel_resources.py --tuple-kernels   # the GDN tuple kernels (hypic/kernels/gdn_tuples.py)
    python scripts/kernel_resources.py --mamba2-decode 1  # the fused Mamba2 decode step at Nemotron 3 Nano's shape
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from hypic.config import SEGMENT_STATE_DTYPES
from hypic.kernels import compose, gdn_tuples, mamba2_decode, mla_attention
from hypic.kernels.linear_families import get_family
from hypic.kernels.triton_lazy import bind_module

POINTERS = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*bf16", "o": "*bf16",
            "pool": "*fp32", "slots": "*i64", "has_state": "*i1", "cu_seqlens": "*i32", "ptr": "*i32",
            "at": "*i32", "t_off": "*i64", "s0_off": "*i64", "t_src": "*fp32", "s0_src": "*fp32", "scale": "fp32",
            "save_at": "*i64", "save_slots": "*i64"}
TRITON_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}  # of the cached tuples' sources
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")  # address, opcode
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def compile_walk(args: argparse.Namespace) -> Any:
    """The walk kernel compiled as `compose_and_recur_triton` would launch it."""
    kernel = bind_module(vars(compose))["_compose_recur_kernel"]
    family = get_family(args.family)
    tuple_dtype = getattr(torch, args.tuple_dtype)
    config = walk_config(args)
    constants = compose.launch_constants(family, args.key_heads, args.value_heads, args.key_dim, args.value_dim,
                                         config)
    constants["HAS_CHECKPOINTS"] = True  # the engine's walks always pass their (maybe empty) checkpoints
    constants["L2_PREFETCH"] = True  # as on a GPU
    pointers = dict(POINTERS, t_src=TRITON_TYPES[family.t_storage_dtype(tuple_dtype)], s0_src=TRITON_TYPES[tuple_dtype])
    return compile_sm90(kernel, constants, pointers, {"num_warps": config.num_warps})


# Kimi-Linear-48B-A3B's MLA: 32 heads, kv_lora_rank 512, rope 64; pages of 16 tokens
MLA_SHAPE = {"heads": 32, "rank": 512, "rope": 64, "page": 16}


def compile_mla(tokens: int) -> tuple[mla_attention.LatentTiling, Any]:
    """The latent kernel compiled as `mla_attention_triton` would launch it (bf16) for one chunk of
    `tokens` queries (1: decodes) over 16k keys; `LatentTiling.choose` picks the tile."""
    kernel = bind_module(vars(mla_attention))["_mla_kernel"]
    s = MLA_SHAPE
    q = torch.empty(1, s["heads"], s["rank"] + s["rope"], dtype=torch.bfloat16)
    tiling = mla_attention.LatentTiling.choose(q, s["rank"], (1,) * 64 if tokens == 1 else (tokens,), 16384)
    constants = mla_attention.launch_constants(s["heads"], s["rank"], s["rope"], s["page"], torch.bfloat16, tiling)
    pointers = {"q": "*bf16", "pages": "*bf16", "block_tables": "*i32", "kv_lens": "*i32", "positions": "*i64",
                "cu_seqlens": "*i32", "out": "*fp32" if tiling.splits > 1 else "*bf16", "lse": "*fp32",
                "scale_log2": "fp32"}
    options = {"num_warps": tiling.warps, "num_stages": tiling.stages}
    return tiling, compile_sm90(kernel, constants, pointers, options)


def compile_tuple_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """The chunk-factor and ordered-product kernels compiled as `gdn_span_tuples_triton` launches
    them on bf16 operands."""
    shape = {"H": args.key_heads, "HV": args.value_heads, "K": args.key_dim, "V": args.value_dim,
             "BK": gdn_tuples.block_dim(args.key_dim)}
    pointers = {"k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*bf16", "factors": "*fp32", "out": "*fp32",
                "chunk_rows": "*i32", "chunk_sizes": "*i32", "span_firsts": "*i32", "span_counts": "*i32"}
    extra = {"_chunk_factor_kernel": ({"C": gdn_tuples.CHUNK, "BN": gdn_tuples.COLUMN_BLOCK}, {}),
             "_ordered_product_kernel": ({"BJ": gdn_tuples.COLUMN_BLOCK}, {"num_stages": gdn_tuples.PRODUCT_STAGES})}
    return {name: compile_sm90(bind_module(vars(gdn_tuples))[name], {**shape, **constants}, pointers,
                               {"num_warps": gdn_tuples.NUM_WARPS, **options})
            for name, (constants, options) in extra.items()}


# Nemotron 3 Nano (30B-A3B)'s Mamba2 layers
MAMBA2_SHAPE = {"heads": 64, "head_dim": 64, "state": 128, "groups": 8, "width": 4}


def compile_mamba2_decode(tokens: int, shape: dict[str, int] = MAMBA2_SHAPE) -> dict[str, Any]:
    """The step and norm kernels compiled as `mamba2_decode_triton` launches them (bf16) for a decode
    batch of `tokens` sequences of layers of `shape` (MAMBA2_SHAPE's keys)."""
    s = shape
    inner = s["heads"] * s["head_dim"]
    conv_dim = inner + 2 * s["groups"] * s["state"]
    meta = dict(device="meta")
    per_head = (torch.empty(s["heads"], **meta),) * 3  # A_log, dt_bias, D
    layer = mamba2_decode.Mamba2DecodeLayer(
        torch.empty(conv_dim, s["width"], **meta), torch.empty(conv_dim, **meta), *per_head, torch.empty(inner, **meta),
        1e-5, s["heads"], s["head_dim"], s["groups"], s["state"], (0.0, float("inf")))
    _, step = mamba2_decode.step_launch(layer, torch.empty(tokens, conv_dim, **meta),
                                        torch.empty(tokens, s["heads"], s["head_dim"], **meta))
    norm, warps = mamba2_decode.norm_launch(layer)
    pointers = {name: "*bf16" for name in ("xbc", "dt", "z", "w", "bias", "norm_w", "y", "out", "conv_pool")}
    pointers.update({name: "*fp32" for name in ("A_log", "dt_bias", "D", "pool")}, slots="*i64", has_state="*i1",
                    dt_min="fp32", dt_max="fp32", eps="fp32")
    kernels = bind_module(vars(mamba2_decode))
    return {"_ssd_step_kernel": compile_sm90(kernels["_ssd_step_kernel"], step, pointers, {"num_warps": 4}),
            "_group_norm_kernel": compile_sm90(kernels["_group_norm_kernel"], norm, pointers, {"num_warps": warps})}


def compile_sm90(kernel, constants: dict, pointers: dict[str, str], options: dict) -> Any:
    """A Triton kernel compiled for Hopper (its cubin in .asm, its dynamic shared memory in .metadata):
    `constants` its constexprs, `pointers` the other arguments' types (int32 if not named)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    # pointers 16-byte aligned, as Triton's launcher specialises torch's allocations (but those the kernel
    # leaves unspecialised)
    unaligned = kernel.fn.jit_options["do_not_specialize_on_alignment"]
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*") and name not in unaligned}
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()},
                       attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def walk_config(args: argparse.Namespace) -> compose.WalkConfig:
    """The engine's launch shape for these heads, with --block-v / --num-warps in its place if given."""
    default = compose.walk_config(get_family(args.family), args.value_dim)
    return compose.WalkConfig(block_v=args.block_v or default.block_v, num_warps=args.num_warps or default.num_warps)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's report on a cubin (Triton ships the tool)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(tool), flag, file.name], capture_output=True, text=True, check=True).stdout


def resource_usage(compiled: Any) -> str:
    """cuobjdump's resource line (its SHARED is static only) and the dynamic shared memory of a launch."""
    line = next(line.strip() for line in cuobjdump(compiled.asm["cubin"], "--dump-resource-usage").splitlines()
                if "REG:" in line)
    return f"{line} DYNAMIC_SHARED:{compiled.metadata.shared}"


def sass_code(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, line) of each SASS instruction."""
    return [(int(m[1], 16), m[2], line) for line in cuobjdump(cubin, "-sass").splitlines()
            if (m := SASS_LINE.search(line))]


def sass_loops(cubin: bytes) -> list[str]:
    """The SASS's loops (backward branches), in program order: instructions from head to branch (an
    outer loop's count includes its inner loops' bodies once) and the most frequent opcodes."""
    code = sass_code(cubin)
    start = {address: i for i, (address, _, _) in enumerate(code)}
    loops = []
    for end, (address, opcode, line) in enumerate(code):
        target = BRANCH_TARGET.search(line) if opcode == "BRA" else None
        if target and int(target[1], 16) < address:
            body = Counter(op.split(".")[0] for _, op, _ in code[start[int(target[1], 16)]: end + 1])
            top = ", ".join(f"{op} {n}" for op, n in body.most_common(8))
            loops.append(f"loop {int(target[1], 16):#07x}-{address:#07x}: {body.total():5} instructions ({top})")
    return loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=tuple(compose.FAMILY_CODES), default="gdn")
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=32)
    parser.add_argument("--key-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=128)
    parser.add_argument("--block-v", type=int, help="value columns a program (default: the engine's)")
    parser.add_argument("--num-warps", type=int, help="warps a program (default: the engine's)")
    parser.add_argument("--tuple-dtype", choices=SEGMENT_STATE_DTYPES, default="float32",
                        help="storage of cached T and S0 (EngineConfig.segment_state_dtype)")
    parser.add_argument("--loops", action="store_true", help="also list the SASS's loops and their instructions")
    parser.add_argument("--mla-tokens", type=int, help="the MLA latent kernel instead, for a chunk of this many "
                        "queries (1: decodes) at the Kimi-Linear-48B shape")
    parser.add_argument("--tuple-kernels", action="store_true", help="the GDN tuple kernels instead of the walk")
    parser.add_argument("--mamba2-decode", type=int, metavar="BATCH", help="the fused Mamba2 decode kernels "
                        "instead, for a decode batch of this many sequences at Nemotron 3 Nano's shape")
    args = parser.parse_args()
    if args.mamba2_decode:
        for name, compiled in compile_mamba2_decode(args.mamba2_decode).items():
            print(f"{name} sm90 {MAMBA2_SHAPE} batch {args.mamba2_decode}: {resource_usage(compiled)}")
        return
    if args.mla_tokens:
        tiling, compiled = compile_mla(args.mla_tokens)
        sass = Counter(op.split(".")[0] for _, op, _ in sass_code(compiled.asm["cubin"]))
        print(f"_mla_kernel sm90 {MLA_SHAPE} {tiling}: {resource_usage(compiled)} "
              f"HGMMA {sass['HGMMA']} HMMA {sass['HMMA']}")
        return
    if args.tuple_kernels:
        for name, compiled in compile_tuple_kernels(args).items():
            print(f"{name} sm90 {vars(args)}: {resource_usage(compiled)}")
        return
    compiled = compile_walk(args)
    print(f"_compose_recur_kernel sm90 {vars(args)} {walk_config(args)}: {resource_usage(compiled)}")
    if args.loops:
        print("\n".join(sass_loops(compiled.asm["cubin"])))


if __name__ == "__main__":
    main()
