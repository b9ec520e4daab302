"""What a cold step's tuple capture adds, op by op, at the Nemotron 3 Nano shape (issue 24), on the CPU.

One step of J cold segments (default 8 x 2048 tokens, seam 8: what bench_pic's tuple overhead runs)
goes through the capture path on meta tensors that say they are CUDA ones (real shapes, dtypes and the
GPU code path; no data, no GPU), and a dispatch mode counts its aten ops, its dtype conversions
and the bytes they read and write (from the shapes; views move nothing): per Mamba2 layer (`T`, `S0`,
conv tail), per attention layer (interior K and V) and per step (storing the tuples in the pool).
The plain forward's own ops are not run: everything counted is what the capture adds to it.

    python scripts/capture_cost.py --label after
    git archive 5ac4923 | tar -x -C /tmp/before && echo 5ac4923 > /tmp/before/COMMIT
    PYTHONPATH=/tmp/before python scripts/capture_cost.py --label before
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from bench_engine import shape_config
from op_count import DTYPE, GPU, OpCounter, gpu_empty
from results import result_path, write_labelled_run

import hypic
from hypic.cache import segment_store
from hypic.cache.segment_store import SegmentKey, SegmentLayout, SegmentStore
from hypic.engine.pic.plan import SegmentJob
from hypic.engine.pic.state import PicState
from hypic.kernels import varlen
from hypic.kernels.varlen import Operands
from hypic.models.batch import Capture, PicStep
from hypic.models.mamba2 import Mamba2Mixer
from hypic.models.mamba2_config import Mamba2HybridConfig


def nemotron() -> tuple[Mamba2HybridConfig, SegmentLayout]:
    config = Mamba2HybridConfig.from_dict(shape_config("nemotron3_nano", 32768))
    with torch.device("meta"):
        mixer = Mamba2Mixer(config)
    num_full = config.blocks.count(Mamba2HybridConfig.FULL)
    linear = (mixer.shape,) * config.blocks.count(Mamba2HybridConfig.LINEAR)
    return config, SegmentLayout(linear, num_full, config.num_key_value_heads, config.head_dim, DTYPE, DTYPE)


def cold_step(config: Mamba2HybridConfig, layout: SegmentLayout, jobs: int, length: int, seam: int) -> dict:
    """The counts of one step of `jobs` cold segments of `length` tokens each."""
    with torch.device("meta"):
        mixer = Mamba2Mixer(config)
    n = jobs * length
    store = SegmentStore(layout, jobs * layout.entry_bytes(length), GPU)
    capture, pics = (build if STAGED else build_before)(layout, jobs, length, seam)
    pic = PicStep(None, capture, store)
    conv_out = gpu_empty(n, mixer.conv_dim)
    _, b, c = mixer.split(conv_out)
    x = Operands(c, b, gpu_empty(n, mixer.num_heads, mixer.head_dim),
                 gpu_empty(n, mixer.num_heads, dtype=torch.float32), None)
    conv_in = gpu_empty(n, mixer.conv_dim)
    qkv = gpu_empty(n, (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim)
    q_size = config.num_attention_heads * config.head_dim
    kv = qkv.narrow(1, q_size, qkv.shape[1] - q_size).unflatten(1, (2, config.num_key_value_heads,
                                                                    config.head_dim))
    counts = {}
    with OpCounter() as counter:
        mixer._capture(pic, conv_in, x, 0)
    counts["per_mamba2_layer"] = counter.summary()
    for index in range(1, layout.num_linear):  # the other layers, uncounted: storing needs them all
        mixer._capture(pic, conv_in, x, index)
    with OpCounter() as counter:
        capture.add_full(kv[:, 0], kv[:, 1])
    counts["per_attention_layer"] = counter.summary()
    for _ in range(1, layout.num_full):
        capture.add_full(kv[:, 0], kv[:, 1])
    with OpCounter() as counter:
        (store_all if STAGED else store_all_before)(capture, pics, store)
    counts["per_step_store"] = counter.summary()
    return counts


def cold_jobs(layout: SegmentLayout, jobs: int, length: int, seam: int) -> tuple[list[PicState], list[list[int]]]:
    """The jobs' states (one chunk each, rows job after job) and the flat rows of their conv tails."""
    width, interior = layout.conv_kernel, (max(seam, layout.conv_kernel - 1), length - seam)
    pics = []
    for j in range(jobs):
        pics.append(PicState())
        pics[-1].job = SegmentJob(SegmentKey(bytes([j]) * 16, None), (0,) * length, interior, False)
    return pics, [[j * length + interior[1] - width + 1 + t for t in range(width - 1)] for j in range(jobs)]


def build(layout: SegmentLayout, jobs: int, length: int, seam: int) -> tuple[Capture, list[PicState]]:
    """The Capture `hypic.engine.pic.step.build_capture` makes for `jobs` cold segments, one chunk each."""
    pics, tails = cold_jobs(layout, jobs, length, seam)
    (start, end), flags = pics[0].job.interior, (False,) * jobs
    spans = varlen.RowSpans.build(tuple(j * length + start for j in range(jobs)), (end - start,) * jobs, GPU)
    return Capture(jobs=tuple(range(jobs)), identity_T=flags, priors=(None,) * jobs, ends=(True,) * jobs,
                   spans=spans, tail_rows=torch.tensor(tails, device=GPU),
                   staged=segment_store.TupleStaging(layout, jobs, jobs * (end - start), GPU), ending=None), pics


def store_all(capture: Capture, pics: list[PicState], store: SegmentStore) -> None:
    """What `PicAssembler.after_step` does with a step's capture: store each job's staged tuple."""
    starts = itertools.accumulate(capture.spans.lens, initial=0)
    for j, start in zip(range(len(pics)), starts):
        kv = capture.staged.kv[start:start + capture.spans.lens[j]]
        store.put_staged(pics[j].job.key, pics[j].job.interior, capture.staged.fixed[j], [kv])


# The tree before issue 24's change (main at 5ac4923: `--tree` an export of it, put first on PYTHONPATH)
# kept float32 tuples per layer and copied them part by part into the pool after the step.

def build_before(layout: SegmentLayout, jobs: int, length: int, seam: int) -> tuple[Capture, list[PicState]]:
    pics, tails = cold_jobs(layout, jobs, length, seam)
    (start, end), lens = pics[0].job.interior, (pics[0].job.interior[1] - pics[0].job.interior[0],) * jobs
    rows = [j * length + r for j in range(jobs) for r in range(start, end)]
    return Capture(jobs=tuple(range(jobs)), identity_T=(False,) * jobs, priors=(None,) * jobs, ends=(True,) * jobs,
                   rows=torch.tensor(rows, device=GPU), seq_lens=lens, tail_rows=torch.tensor(tails, device=GPU),
                   cu_seqlens=torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32,
                                           device=GPU)), pics


def store_all_before(capture: Capture, pics: list[PicState], store: SegmentStore) -> None:
    from hypic.engine.pic import assembly
    starts = itertools.accumulate(capture.seq_lens, initial=0)
    for j, start in zip(range(len(pics)), starts):
        assembly._keep(pics[j], capture, j, start)
        store.put(pics[j].job.key, assembly._complete(pics[j], capture.conv_tail, j))


STAGED = "staged" in Capture.__dataclass_fields__  # the tree on the path has this capture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="before | after")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--seam", type=int, default=8)
    parser.add_argument("--out", type=Path, default=result_path("capture_cost", "cpu", "nemotron3_nano"))
    args = parser.parse_args()
    args.tree = Path(hypic.__file__).resolve().parents[1]  # the tree measured: the hypic on the path
    config, layout = nemotron()
    counts = cold_step(config, layout, args.jobs, args.length, args.seam)
    per_step = {key: counts["per_mamba2_layer"][key] * layout.num_linear
                + counts["per_attention_layer"][key] * layout.num_full + counts["per_step_store"][key]
                for key in ("ops", "bytes_read", "bytes_written", "dtype_conversions")}
    results = {"shape": f"{args.jobs}x{args.length}", "seam": args.seam, "mamba2_layers": layout.num_linear,
               "attention_layers": layout.num_full, **counts, "per_step": per_step}
    for part in ("per_mamba2_layer", "per_attention_layer", "per_step_store"):
        c = counts[part]
        print(f"{part:20s} {c['ops']:6d} ops  {c['bytes_read'] / 1e6:9.1f} MB read  "
              f"{c['bytes_written'] / 1e6:9.1f} MB written  {c['dtype_conversions']:4d} conversions")
    print(f"{'per_step':20s} {per_step['ops']:6d} ops  {per_step['bytes_read'] / 1e6:9.1f} MB read  "
          f"{per_step['bytes_written'] / 1e6:9.1f} MB written  {per_step['dtype_conversions']:4d} conversions")
    write_labelled_run(args, "capture_cost", [], results)


if __name__ == "__main__":
    main()
