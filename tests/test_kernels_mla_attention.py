"""Paged latent (MLA) attention: the absorbed form over latent pages against a float64 oracle that
expands per-head keys and values (k = [W_uk c | k_pe], v = W_uv c), and the Triton kernel (interpreted
on CPU, on CUDA when present) against it: decodes over long contexts, a short prefill over a long
context (a PIC seam), pages out of order, heads not a multiple of the tile; forced tiles of several
tokens with their own causal ends, output channels in two parts, KV ranges split and merged, heads
over two tiles; on CUDA the 48B shape's own tiles. The expanded prefill attention against the same
kind of oracle (CPU) and the CPU path (CUDA)."""
from __future__ import annotations

import itertools
import types

import pytest
import torch

from hypic.kernels.mla_attention import (LatentTiling, chunk_rows, mla_attention_ref, mla_attention_triton,
                                         mla_expanded_attention)
from kernel_cases import interpreted, rel_err

HEADS, RANK, ROPE, NOPE, V_DIM, BLOCK = 5, 32, 16, 24, 20, 8
KIMI_48B = dict(heads=32, rank=512, rope=64, nope=128)  # Kimi-Linear-48B-A3B's MLA


def make_case(kv_lens: list[int], query_lens: list[int], seed: int, dtype=torch.float32, device="cpu",
              heads: int = HEADS, rank: int = RANK, rope: int = ROPE, nope: int = NOPE):
    """Latent pages (shuffled), per-sequence block tables, and queries at the last query_lens positions."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // BLOCK) for n in kv_lens) + 1
    pages = torch.randn(blocks, BLOCK, 1, rank + rope, generator=g)
    order = torch.randperm(blocks - 1, generator=g) + 1
    tables, used = [], 0
    for n in kv_lens:
        need = -(-n // BLOCK)
        tables.append(order[used:used + need].tolist())
        used += need
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor([p for n, m in zip(kv_lens, query_lens) for p in range(n - m, n)])
    w_uk = torch.randn(heads, nope, rank, generator=g) / rank ** 0.5
    q_nope = torch.randn(positions.numel(), heads, nope, generator=g)
    q_pe = torch.randn(positions.numel(), heads, rope, generator=g)
    q_abs = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_pe], -1)
    on = lambda x, dt=None: x.to(device, dt) if dt else x.to(device)  # noqa: E731
    return (on(q_abs, dtype), on(pages, dtype), on(table), on(torch.tensor(kv_lens, dtype=torch.int32)),
            on(positions), tuple(query_lens))


def oracle(q_abs, pages, table, kv_lens, positions, query_lens, scale, rank=RANK):
    """Float64 softmax over each sequence's latent rows, causal by position: [N, H, rank]."""
    q_abs, pages, table, kv_lens, positions = (x.cpu() for x in (q_abs, pages, table, kv_lens, positions))
    out, starts = [], list(itertools.accumulate(query_lens, initial=0))
    for b, n in enumerate(kv_lens.tolist()):
        rows = pages.double()[table[b].long()].flatten(0, 1)[:n, 0]
        for i in range(starts[b], starts[b + 1]):
            visible = rows[: int(positions[i]) + 1]
            p = torch.softmax(q_abs[i].double() @ visible.T * scale, -1)
            out.append(p @ visible[:, :rank])
    return torch.stack(out)


def cu_of(query_lens: tuple[int, ...], device="cpu") -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32, device=device)


def triton_error(case, scale: float = 0.2, rank: int = RANK, tiling: LatentTiling | None = None) -> float:
    q, pages, table, lens, pos, qlens = case
    o = mla_attention_triton(q, pages, table, lens, pos, cu_of(qlens, q.device), scale=scale, rank=rank,
                             seq_lens_cpu=qlens, max_kv_len=int(lens.max()), tiling=tiling)
    assert o.shape == (pos.numel(), q.shape[1], rank)
    return rel_err(o.cpu(), oracle(q, pages, table, lens, pos, qlens, scale, rank))


CASES = [([70, 9, 33], [1, 1, 1]), ([100, 21], [6, 1]), ([40], [40])]


@pytest.mark.parametrize("kv_lens,query_lens", CASES)
def test_reference_matches_float64_oracle(kv_lens, query_lens) -> None:
    q, pages, table, lens, pos, qlens = make_case(kv_lens, query_lens, seed=len(kv_lens))
    o = mla_attention_ref(q, pages, table, lens, pos, cu_of(qlens), scale=0.2, rank=RANK, seq_lens_cpu=qlens,
                          max_kv_len=max(kv_lens))
    assert o.shape == (pos.numel(), HEADS, RANK)
    assert rel_err(o, oracle(q, pages, table, lens, pos, qlens, 0.2)) <= 1e-5


# (tokens, head tile, parts, KV tile, splits, warps): several tokens of different causal ends a tile,
# rank in two halves, three KV splits (some empty for the early tokens), 5 heads over two tiles of 4
FORCED_TILINGS = [None, LatentTiling(4, 8, 2, 16, 3, 4), LatentTiling(4, 4, 1, 16, 2, 4)]


@interpreted
@pytest.mark.parametrize("tiling", FORCED_TILINGS, ids=["chosen", "parts-splits", "head-tiles"])
def test_triton_interpreted_matches_float64_oracle(tiling, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_error(make_case([45, 9, 30], [6, 1, 5], seed=7), tiling=tiling) <= 1e-5


@interpreted
def test_triton_interpreted_at_the_48b_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 512 + rope 64 in the seam tile (four tokens of 32 heads, two halves of 256 channels), split."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case([100, 70], [3, 4], seed=5, **KIMI_48B)
    assert triton_error(case, scale=192 ** -0.5, rank=512, tiling=LatentTiling(4, 32, 2, 32, 3, 8)) <= 1e-5


def test_tiles_pack_tokens_and_split_wide_ranks() -> None:
    """The 48B shape: a decode tile is one token's 32 heads over all 512 channels; a seam chunk's
    packs four tokens in two halves of the channels; a lone decode over 16k keys splits them."""
    q = torch.empty(1, 32, 576, dtype=torch.bfloat16)
    decode, seams = (LatentTiling.choose(q, 512, lens, 16384) for lens in ((1,) * 200, (150,)))
    assert (decode.rows, decode.parts, decode.splits) == (32, 1, 1)
    assert (seams.tokens, seams.rows, seams.parts) == (4, 128, 2)
    assert LatentTiling.choose(q, 512, (1,), 16384).splits > 1
    with pytest.raises(ValueError, match="rows >= 16"):
        mla_attention_triton(q, torch.empty(1, 8, 1, 576), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1),
                             torch.zeros(1), torch.tensor([0, 1]), scale=1.0, rank=512, seq_lens_cpu=(1,),
                             max_kv_len=1, tiling=LatentTiling(1, 8, 1, 16, 1, 4))


@pytest.mark.parametrize("shared_kb,rows", [(228, 128), (164, 64)], ids=["hopper", "a100"])
def test_seam_tiles_fit_the_devices_shared_memory(shared_kb, rows, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four tokens a tile where a program may take 216 KB of shared memory, two where it may not."""
    props = types.SimpleNamespace(shared_memory_per_multiprocessor=shared_kb * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert chunk_rows(torch.device("cuda")) == rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_lens,query_lens", CASES + [([3000, 700], [1, 1]), ([2500], [150])])
def test_triton_on_gpu_matches_float64_oracle(kv_lens, query_lens, dtype, bound) -> None:
    """The tiles `LatentTiling.choose` picks; the long cases split their KV ranges."""
    assert triton_error(make_case(kv_lens, query_lens, seed=3, dtype=dtype, device="cuda")) <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("kv_lens,query_lens", [([1500, 300], [1, 1]), ([1200, 2100], [40, 90]), ([900], [1])])
@pytest.mark.parametrize("tiling", [None, LatentTiling(4, 32, 2, 32, 3, 8), LatentTiling(1, 32, 1, 32, 4, 8)],
                         ids=["chosen", "seam-tile-split", "decode-tile-split"])
def test_triton_on_gpu_at_the_48b_shape(kv_lens, query_lens, tiling) -> None:
    """bf16 at 32 heads x rank 512 + rope 64: the chosen tiles (decodes: one token, mma; chunks: four
    tokens in channel halves, wgmma; lone decodes split) and both forced to split."""
    case = make_case(kv_lens, query_lens, seed=5, dtype=torch.bfloat16, device="cuda", **KIMI_48B)
    assert triton_error(case, scale=192 ** -0.5, rank=512, tiling=tiling) <= 2e-2


def expanded_case(n: int, length: int, heads: int, dims: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, heads, d, generator=g) for rows, d in ((n, dims[0]), (length, dims[0]),
                                                                          (length, dims[1])))


def expanded_oracle(q, keys, values, scale):
    """Float64: query i sees keys j <= L - n + i."""
    n, length = q.shape[0], keys.shape[0]
    s = torch.einsum("nhd,lhd->hnl", q.double(), keys.double()) * scale
    s = s.masked_fill(torch.arange(length)[None, :] > torch.arange(length - n, length)[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), values.double())


@pytest.mark.parametrize("n,length", [(7, 7), (5, 19)])
def test_expanded_attention_matches_float64_oracle(n, length) -> None:
    q, keys, values = expanded_case(n, length, 3, (24, 20), seed=n)
    o = mla_expanded_attention(q, keys, values, 0.3)
    assert o.shape == (n, 3, 20) and rel_err(o, expanded_oracle(q, keys, values, 0.3)) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n,length,heads,dims", [(300, 300, 4, (192, 128)), (257, 1100, 32, (192, 128)),
                                                  (130, 500, 4, (24, 12))])
def test_expanded_attention_on_gpu_matches_float64_oracle(n, length, heads, dims, dtype, bound) -> None:
    """SDPA causal from the bottom right with V padded to the key width (the 48B shape's 192 / 128
    and the tiny checkpoints' 24 / 12), square and not."""
    q, keys, values = (x.to("cuda", dtype) for x in expanded_case(n, length, heads, dims, seed=1))
    o = mla_expanded_attention(q, keys, values, 192 ** -0.5)
    assert o.dtype == dtype and o.shape == (n, heads, dims[1])
    assert rel_err(o.cpu(), expanded_oracle(q.cpu(), keys.cpu(), values.cpu(), 192 ** -0.5)) <= bound


@pytest.mark.parametrize("interpret", [False, pytest.param(True, marks=interpreted)])
def test_scatter_of_latent_rows_into_shared_pages(interpret: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """PIC's scatter with V at offset 0 (the latent row is K and V) into pages that are both caches:
    each cached row lands unrotated (NoPE: no rotary channels) where the block table says."""
    from hypic.kernels.scatter_kv import scatter_kv_ref, scatter_kv_triton

    g = torch.Generator().manual_seed(11)
    src = torch.randn(6 * (RANK + ROPE), generator=g)
    pages = torch.zeros(4, BLOCK, 1, RANK + ROPE)
    src_off = torch.arange(6) * (RANK + ROPE)
    dst = torch.tensor([9, 2, 30, 31, 0, 17])
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    scatter = scatter_kv_triton if interpret else scatter_kv_ref
    scatter(src, src_off, torch.arange(100, 106), pages, pages, dst, torch.empty(0), v_offset=0)
    assert torch.equal(pages.view(-1, RANK + ROPE)[dst], src.view(6, -1))
    assert int((pages.view(-1, RANK + ROPE).abs().sum(-1) > 0).sum()) == 6
