"""Paged attention: the reference against dense causal attention on unpaged tensors; the Triton
kernel (decode with split KV, varlen prefill over pages) against the reference; write_kv."""
from __future__ import annotations

import pytest
import torch

from hypic.kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton, write_kv
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


def run_triton(pb: PagedBatch, num_decodes: int, scale: float) -> torch.Tensor:
    """The Triton kernel as the dispatcher calls it: decodes, then the prefill sequences."""
    out = torch.empty_like(pb.q)
    starts = pb.cu_seqlens.tolist()
    for first_seq, seq_lens in ((0, pb.seq_lens[:num_decodes]), (num_decodes, pb.seq_lens[num_decodes:])):
        if seq_lens:
            paged_attention_triton(pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.kv_lens, pb.positions,
                                   pb.cu_seqlens, scale=scale, out=out, first_seq=first_seq,
                                   first_token=starts[first_seq], seq_lens=seq_lens,
                                   max_kv_len=int(pb.kv_lens.max()))
    return out


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


# ----------------------------------------------------------------------------- GPU (Qwen3.5-35B-A3B full attention)

GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, GPU_BLOCK = 16, 2, 256, 16


def gpu_batch(kv_lens: list[int], q_lens: list[int], dtype: torch.dtype, seed: int) -> PagedBatch:
    pb = make_paged(kv_lens, q_lens, GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, GPU_BLOCK,
                    torch.Generator().manual_seed(seed), dtype)
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
