"""Paged attention: the reference against dense causal attention on unpaged tensors; the Triton
kernel (decode and short prefill with split KV, varlen prefill over pages) against the reference;
the split rule; write_kv."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from hypic.kernels import activation
from hypic.kernels import paged_attention as paged_attention_module
from hypic.kernels.paged_attention import (NARROW_PREFILL_TILINGS, PREFILL_SPLIT_MIN_KV, SPLIT_TILING, Tiling,
                                           paged_attention, paged_attention_ref, paged_attention_triton, write_kv)
from kernel_cases import PagedBatch, dense_causal_attention, interpreted, make_paged, rel_err


def call(fn, pb: PagedBatch, num_decodes: int, scale: float) -> torch.Tensor:
    return fn(pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.kv_lens, pb.positions, pb.cu_seqlens,
              scale=scale, num_decodes=num_decodes, seq_lens_cpu=pb.seq_lens, max_kv_len=int(pb.kv_lens.max()))


def dense(pb: PagedBatch, scale: float) -> torch.Tensor:
    starts = pb.cu_seqlens.tolist()
    return torch.cat([dense_causal_attention(pb.q[s:e], pb.dense_k[b], pb.dense_v[b], pb.positions[s:e], scale)
                      for b, (s, e) in enumerate(zip(starts, starts[1:]))])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("kv_lens,q_lens,num_decodes", [
    ([5, 33, 1], [1, 1, 1], 3),  # decodes only
    ([9, 40, 40, 17], [1, 1, 12, 17], 2),  # decodes, a chunk continuing KV already in pages, a fresh prefill
    ([300], [300], 0),  # longer than one reference query chunk
])
def test_reference_matches_dense_attention(heads: int, kv_heads: int, kv_lens: list[int], q_lens: list[int],
                                           num_decodes: int) -> None:
    gen = torch.Generator().manual_seed(heads + len(kv_lens))
    pb = make_paged(kv_lens, q_lens, heads, kv_heads, head_dim=8, block_size=4, gen=gen)
    out = call(paged_attention_ref, pb, num_decodes, scale=0.3)
    torch.testing.assert_close(out.double(), dense(pb, 0.3), rtol=1e-5, atol=1e-5)


def test_reference_keeps_query_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    pb = make_paged([7, 5], [1, 5], 4, 2, head_dim=8, block_size=4, gen=gen, dtype=torch.bfloat16)
    out = call(paged_attention, pb, 1, scale=0.3)
    assert out.dtype == torch.bfloat16 and out.shape == pb.q.shape
    assert rel_err(out, dense(pb, 0.3)) < 1e-2


def test_write_kv_writes_each_token_at_its_slot() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8)
    slots = torch.randperm(20, generator=gen)[:7]
    k, v = torch.randn(7, 2, 8, generator=gen), torch.randn(7, 2, 8, generator=gen)
    write_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache.flatten(0, 1)[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.flatten(0, 1)[slots], v, rtol=0, atol=0)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.flatten(0, 1)[untouched].any() and not v_cache.flatten(0, 1)[untouched].any()


def with_positions(pb: PagedBatch, positions: list[int]) -> PagedBatch:
    """The batch with its queries at `positions` (seam windows spread over the KV, say)."""
    return dataclasses.replace(pb, positions=torch.tensor(positions, dtype=torch.long, device=pb.q.device))


def run_triton(pb: PagedBatch, num_decodes: int, scale: float, max_kv_len: int | None = None,
               splits: int | None = None, shape: Tiling | None = None, gate: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The Triton kernel as the dispatcher calls it: decodes, then the prefill sequences. Host values
    only (no device reads), so that it can run inside a CUDA graph capture."""
    out = torch.empty_like(pb.q)
    starts = list(itertools.accumulate(pb.seq_lens, initial=0))
    for first_seq, seq_lens in ((0, pb.seq_lens[:num_decodes]), (num_decodes, pb.seq_lens[num_decodes:])):
        if seq_lens:
            paged_attention_triton(pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.kv_lens, pb.positions,
                                   pb.cu_seqlens, scale=scale, out=out, first_seq=first_seq,
                                   first_token=starts[first_seq], seq_lens=seq_lens,
                                   max_kv_len=max_kv_len or int(pb.kv_lens.max()), splits=splits, shape=shape,
                                   gate=gate)
    return out


def gated_ref(pb: PagedBatch, num_decodes: int, scale: float, gate: torch.Tensor) -> torch.Tensor:
    """The reference's output times sigmoid(gate), the unfused gate's arithmetic (in q's dtype)."""
    out = call(paged_attention_ref, pb, num_decodes, scale)
    return (out.reshape(out.shape[0], -1) * torch.sigmoid(gate)).view(out.shape)


def make_gate(pb: PagedBatch, seed: int) -> torch.Tensor:
    """A row-strided [N, Hq * D] gate, as Qwen's projection's gate columns."""
    tokens, width = pb.q.shape[0], pb.q[0].numel()
    both = torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(seed)).to(pb.q.device, pb.q.dtype)
    return both[:, width:]


# On the CPU the rule pretends 4 SMs (about 8 programs fill them). float32, 4 heads over 2 KV heads:
# rows of 16 = 8 tokens x a group of 2.
@pytest.mark.parametrize("seq_lens,max_kv_len,splits", [
    ((1, 1), 600, 2),  # decodes: 4 programs
    ((6,), PREFILL_SPLIT_MIN_KV, 4),  # a short prefill over long KV: 2 programs
    ((6, 3), 4096, 1),  # a tile each, 4 programs: a prefill with a program per SM stays whole
    ((6,), PREFILL_SPLIT_MIN_KV - 1, 1),  # short KV: a prefill's walk is short anyway
    ((64,), 4096, 1),  # 16 programs fill the GPU
])
def test_split_rule(seq_lens: tuple[int, ...], max_kv_len: int, splits: int) -> None:
    q, k_cache = torch.empty(sum(seq_lens), 4, 8), torch.empty(1, 8, 2, 8)
    tiling = Tiling.choose(q, k_cache, seq_lens, max_kv_len)
    assert (tiling.splits, tiling.tokens) == (splits, 8)


def test_forced_splits() -> None:
    q, k_cache = torch.empty(64, 4, 8), torch.empty(1, 8, 2, 8)
    assert Tiling.choose(q, k_cache, (64,), 4096, splits=3).splits == 3
    with pytest.raises(ValueError, match="at least one KV split"):
        Tiling.choose(q, k_cache, (64,), 4096, splits=0)


def test_forced_shape_takes_its_own_split_count() -> None:
    """A forced tile of 32 rows (16 tokens x a group of 2) sizes the split count by its own programs:
    12 tokens over long KV are 4 programs in the default tiles of 8 tokens (the 4 pretend SMs: one
    split) but 2 in tiles of 16 (4 splits)."""
    q, k_cache = torch.empty(12, 4, 8), torch.empty(1, 8, 2, 8)
    assert Tiling.choose(q, k_cache, (12,), 4096).splits == 1
    tiling = Tiling.choose(q, k_cache, (12,), 4096, shape=Tiling(32, 2, 16, 1, 4))
    assert (tiling.rows, tiling.kv_block, tiling.tokens, tiling.splits) == (32, 16, 16, 4)
    with pytest.raises(ValueError, match="groups of 2"):
        Tiling.choose(q, k_cache, (12,), 4096, shape=Tiling(32, 4, 16, 1, 4))


@interpreted
@pytest.mark.parametrize("heads,kv_heads,q_lens", [
    (4, 2, [1, 1, 12, 19]),  # 600 keys: decodes split the KV range; 19 tokens: prefill tiles straddle pages
    (6, 2, [1, 1, 1, 1]),  # the second group is single tokens too: split results land at its own rows
])
def test_triton_interpreted_matches_reference(heads: int, kv_heads: int, q_lens: list[int],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(heads)
    pb = make_paged([600, 3, 40, 519], q_lens, heads, kv_heads, head_dim=24, block_size=8, gen=gen)
    expected = call(paged_attention_ref, pb, 2, scale=0.2)
    torch.testing.assert_close(run_triton(pb, 2, scale=0.2), expected, rtol=1e-5, atol=1e-5)


@interpreted
def test_triton_interpreted_short_prefill_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-assembly-like step: seam windows over 1100 keys and the final tokens, 6 heads over 2
    KV heads (groups of 3 padded to 4: tiles of 4 tokens). Two KV splits (forced: with 6 programs
    the rule keeps the interpreter's 4 pretend SMs busy unsplit) meet at key 560: the first tile's
    second split is empty, the second tile's (positions 558-561) sees keys 560-561 but its first
    two rows see none there."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pb = make_paged([1100], [12], 6, 2, head_dim=24, block_size=8, gen=torch.Generator().manual_seed(0))
    pb = with_positions(pb, [100, 101, 102, 103, 558, 559, 560, 561, 1096, 1097, 1098, 1099])
    expected = call(paged_attention_ref, pb, 0, scale=0.2)
    torch.testing.assert_close(run_triton(pb, 0, scale=0.2, splits=2), expected, rtol=1e-5, atol=1e-5)
    # the same step in tiles of 8 tokens over KV tiles of 32 keys (bench_attention's wider shapes)
    wide = run_triton(pb, 0, scale=0.2, splits=2, shape=Tiling(32, 4, 32, 1, 4))
    torch.testing.assert_close(wide, expected, rtol=1e-5, atol=1e-5)


@interpreted
def test_triton_interpreted_split_tile_of_a_wide_head_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPLIT_TILING on Nemotron 3's head layout (32 query heads over 2 KV heads: 128 rows are 8
    tokens x 16 heads) in three splits: seam windows of a few tokens over 700 keys, the last tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pb = make_paged([700], [14], 32, 2, head_dim=16, block_size=16, gen=torch.Generator().manual_seed(2))
    pb = with_positions(pb, [0, 1, 2, 3, 230, 231, 232, 233, 466, 467, 468, 697, 698, 699])
    rows, kv_block, warps, stages = SPLIT_TILING
    out = run_triton(pb, 0, scale=0.2, splits=3, shape=Tiling(rows, 16, kv_block, 1, warps, stages))
    torch.testing.assert_close(out, call(paged_attention_ref, pb, 0, scale=0.2), rtol=1e-5, atol=1e-5)


@interpreted
def test_triton_interpreted_forced_splits_mixed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five splits forced on decodes and two prefills over pages, 6 heads over 2 KV heads (tiles of
    4 tokens). Sequence 2 (1300 keys, splits of 272): a tile at 542-545 whose first two rows see
    nothing of split 2. Sequence 3 (77 keys, splits of 16): a tile at 0, 1, 2, 40 whose split 3 is
    empty and whose split 2 is seen by one row; the last split is shorter than the others."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pb = make_paged([1100, 3, 1300, 77], [1, 1, 10, 7], 6, 2, head_dim=24, block_size=8,
                    gen=torch.Generator().manual_seed(1))
    pb = with_positions(pb, [1099, 2, 300, 301, 302, 303, 542, 543, 544, 545, 1298, 1299, 0, 1, 2, 40, 41, 75, 76])
    expected = call(paged_attention_ref, pb, 2, scale=0.2)
    torch.testing.assert_close(run_triton(pb, 2, scale=0.2, splits=5), expected, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("splits", [1, 3])  # gated in place after the kernel; inside the merge
def test_triton_interpreted_gated_output_matches_reference(splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pb = make_paged([600, 3, 40], [1, 1, 9], 4, 2, head_dim=24, block_size=8, gen=torch.Generator().manual_seed(4))
    gate = make_gate(pb, seed=5)
    out = run_triton(pb, 2, scale=0.2, splits=splits, gate=gate)
    torch.testing.assert_close(out, gated_ref(pb, 2, 0.2, gate), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- GPU (Qwen3.5-35B-A3B full attention)

GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, GPU_BLOCK = 16, 2, 256, 16
NEMOTRON_HEADS = (32, 2, 128)  # Nemotron 3 Nano's attention: narrow heads in a group of 16


def gpu_batch(kv_lens: list[int], q_lens: list[int], dtype: torch.dtype, seed: int,
              heads: tuple[int, int, int] = (GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM)) -> PagedBatch:
    pb = make_paged(kv_lens, q_lens, *heads, GPU_BLOCK, torch.Generator().manual_seed(seed), dtype)
    return PagedBatch(*(t.cuda() for t in (pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.kv_lens,
                                            pb.positions, pb.cu_seqlens)), pb.seq_lens, [], [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_lens,q_lens,num_decodes", [
    ([1, 17, 900, 4000, 33] * 8, [1] * 40, 40),  # decodes, split KV
    ([4000], [1], 1),  # one long decode: many splits
    ([5, 2000, 1500, 700], [1, 1, 300, 700], 2),  # decodes + continuing chunk + fresh prefill
    ([4096], [4096], 0),
])
def test_gpu_matches_reference(dtype: torch.dtype, kv_lens: list[int], q_lens: list[int], num_decodes: int) -> None:
    pb = gpu_batch(kv_lens, q_lens, dtype, seed=len(kv_lens))
    scale = GPU_HEAD_DIM ** -0.5
    expected = call(paged_attention_ref, pb, num_decodes, scale)
    out = call(paged_attention, pb, num_decodes, scale)
    assert out.dtype == dtype
    assert rel_err(out, expected) < (1e-2 if dtype != torch.float32 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_lens,q_lens,num_decodes", [
    ([600, 3000, 9, 64], [1] * 4, 4),  # decodes: split KV, gated in the merge
    ([700, 40], [1, 30], 1),  # a decode and a prefill: the prefill gated after its kernel
])
def test_gpu_gated_output_matches_reference(kv_lens: list[int], q_lens: list[int], num_decodes: int) -> None:
    pb = gpu_batch(kv_lens, q_lens, torch.bfloat16, seed=7)
    gate = make_gate(pb, seed=8)
    scale = GPU_HEAD_DIM ** -0.5
    out = paged_attention(pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.kv_lens, pb.positions, pb.cu_seqlens,
                          scale=scale, num_decodes=num_decodes, seq_lens_cpu=pb.seq_lens,
                          max_kv_len=max(kv_lens), gate=gate)
    assert rel_err(out, gated_ref(pb, num_decodes, scale, gate)) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_replays_in_cuda_graph() -> None:
    """Captured with an upper bound for max_kv_len, replayed with shorter and longer real KV."""
    pb = gpu_batch([600, 3000, 9, 64], [1] * 4, torch.bfloat16, seed=3)
    scale = GPU_HEAD_DIM ** -0.5
    out = torch.empty_like(pb.q)

    def step() -> None:
        paged_attention_triton(pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.kv_lens, pb.positions,
                               pb.cu_seqlens, scale=scale, out=out, first_seq=0, first_token=0,
                               seq_lens=pb.seq_lens, max_kv_len=4096)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    pb.q.normal_()
    pb.kv_lens.copy_(torch.tensor([500, 3001, 2, 64], dtype=torch.int32))
    pb.positions.copy_(pb.kv_lens.long() - 1)
    graph.replay()
    assert rel_err(out, call(paged_attention_ref, pb, 4, scale)) < 1e-2


def compiled_variants() -> dict[str, int]:
    """Variants Triton has compiled so far of each kernel a paged-attention step may launch (its
    per-device kernel caches; 0 before the module is bound)."""
    kernels = {name: vars(paged_attention_module)[name] for name in ("_paged_attention_kernel", "_merge_kernel")}
    kernels["_sigmoid_gate_kernel"] = activation._sigmoid_gate_kernel
    return {name: sum(len(caches[0]) for caches in getattr(kernel, "device_caches", {}).values())
            for name, kernel in kernels.items()}


@pytest.mark.gpu
def test_gpu_decode_sweep_compiles_no_new_variants() -> None:
    """Issues 28, 29: after one unsplit and one split decode step, gated decode steps of 1 to 40
    sequences over 9 to 8000 keys (eight split counts or more) compile nothing more. Every sequence reads
    the same pages of one cache (the kernels only read them)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(8000 // GPU_BLOCK, GPU_BLOCK, GPU_KV_HEADS, GPU_HEAD_DIM, generator=gen, device="cuda",
                        dtype=torch.bfloat16)

    def step(kv_lens: list[int]) -> int:
        batch, width = len(kv_lens), -(-max(kv_lens) // GPU_BLOCK)
        q = torch.randn(batch, GPU_HEADS, GPU_HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        tables = torch.arange(width, dtype=torch.int32, device="cuda").expand(batch, width).contiguous()
        gate = torch.randn(batch, GPU_HEADS * GPU_HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
        paged_attention(q, cache, cache, tables, lens, lens.long() - 1,
                        torch.arange(batch + 1, dtype=torch.int32, device="cuda"), scale=GPU_HEAD_DIM ** -0.5,
                        num_decodes=batch, seq_lens_cpu=(1,) * batch, max_kv_len=max(kv_lens), gate=gate)
        return Tiling.choose(q, cache, (1,) * batch, max(kv_lens)).splits

    assert step([40] * 40) == 1 and step([4000]) > 1
    warm = compiled_variants()
    splits = {step([max(1, longest - 13 * i) for i in range(batch)])
              for batch, longest in itertools.product((1, 2, 3, 7, 16, 17, 33, 40), (9, 130, 1000, 8000))}
    torch.cuda.synchronize()
    assert len(splits) >= 8
    assert compiled_variants() == warm


@pytest.mark.gpu
def test_gpu_mixed_step_sweep_compiles_no_new_variants() -> None:
    """float32 steps (one tile for decodes and prefills) of 0 to 9 decodes then 1 to 3 prefill chunks,
    all unsplit: the first step compiles the kernel, the others nothing (the prefill group's first
    sequence and token move with the decodes before it)."""
    def step(num_decodes: int, prefills: tuple[int, ...]) -> None:
        q_lens = [1] * num_decodes + list(prefills)
        pb = gpu_batch([n + 50 for n in q_lens], q_lens, torch.float32, seed=len(q_lens))
        call(paged_attention, pb, num_decodes, GPU_HEAD_DIM ** -0.5)

    step(1, (20,))
    warm = compiled_variants()
    for num_decodes, prefills in itertools.product((0, 1, 2, 9), ((1,), (16, 3), (40, 17, 2))):
        step(num_decodes, prefills)
    torch.cuda.synchronize()
    assert compiled_variants() == warm


def assembly_positions(kv_len: int, seam: int = 8) -> list[int]:
    """A warm PIC assembly step's queries: `seam` tokens at the start of each of 16 cached segments
    spread over the prompt, then the last 64 tokens (192 tokens at seam 8)."""
    prompt = kv_len - 64
    return [k * prompt // 16 + i for k in range(16) for i in range(seam)] + list(range(prompt, kv_len))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [4096, 16384])
@pytest.mark.parametrize("heads,seam", [((GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM), 8), (NEMOTRON_HEADS, 20)])
def test_gpu_short_prefill_splits(kv_len: int, heads: tuple[int, int, int], seam: int) -> None:
    """The assembly step splits its KV range in SPLIT_TILING's tiles (Qwen3.5: 12 tiles x 2 KV heads;
    Nemotron 3, 384 tokens: 48 tiles x 2 KV heads; neither fills the GPU)."""
    positions = assembly_positions(kv_len, seam)
    pb = with_positions(gpu_batch([kv_len], [len(positions)], torch.bfloat16, seed=4, heads=heads), positions)
    tiling = Tiling.choose(pb.q, pb.k_cache, pb.seq_lens, kv_len)
    assert tiling.splits > 1 and (tiling.rows, tiling.kv_block) == SPLIT_TILING[:2]
    scale = heads[2] ** -0.5
    assert rel_err(run_triton(pb, 0, scale), call(paged_attention_ref, pb, 0, scale)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", NARROW_PREFILL_TILINGS, ids=str)
def test_gpu_narrow_prefill_tilings_match_reference(tiling: tuple[int, int, int, int]) -> None:
    """Each tile the narrow-head prefill may time, forced unsplit on a chunk continuing its KV."""
    pb = gpu_batch([3000, 1100], [700, 1100], torch.bfloat16, seed=6, heads=NEMOTRON_HEADS)
    rows, kv_block, warps, stages = tiling
    out = run_triton(pb, 0, 128 ** -0.5, splits=1, shape=Tiling(rows, 16, kv_block, 1, warps, stages))
    assert rel_err(out, call(paged_attention_ref, pb, 0, 128 ** -0.5)) < 1e-2


@pytest.mark.gpu
def test_gpu_narrow_prefill_times_its_tilings() -> None:
    """A long narrow-head prefill fills the GPU unsplit and runs the fastest of its timed tiles."""
    pb = gpu_batch([4096], [4096], torch.bfloat16, seed=7, heads=NEMOTRON_HEADS)
    tiling = Tiling.choose(pb.q, pb.k_cache, pb.seq_lens, 4096)
    assert tiling.splits == 1 and len(tiling.candidates) == len(NARROW_PREFILL_TILINGS)
    assert rel_err(call(paged_attention, pb, 0, 128 ** -0.5), call(paged_attention_ref, pb, 0, 128 ** -0.5)) < 1e-2


@pytest.mark.gpu
def test_gpu_short_prefill_replays_in_cuda_graph() -> None:
    """Captured over 2000 keys with max_kv_len an upper bound (the engine's max_model_len), replayed
    over 9000 keys and other queries."""
    pb = gpu_batch([9000], [192], torch.bfloat16, seed=5)
    scale = GPU_HEAD_DIM ** -0.5
    pb.kv_lens.fill_(2000)
    pb.positions.copy_(torch.tensor(assembly_positions(2000)))
    run_triton(pb, 0, scale, max_kv_len=16384)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_triton(pb, 0, scale, max_kv_len=16384)
    pb.q.normal_()
    pb.kv_lens.fill_(9000)
    pb.positions.copy_(torch.tensor(assembly_positions(9000)))
    graph.replay()
    assert rel_err(out, call(paged_attention_ref, pb, 0, scale)) < 1e-2
