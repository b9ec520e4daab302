"""Paged latent (MLA) attention: the absorbed form over latent pages against a float64 oracle that
expands per-head keys and values (k = [W_uk c | k_pe], v = W_uv c), and the Triton kernel (interpreted
on CPU, on CUDA when present) against the torch reference: decodes over long contexts, a short
prefill over a long context (a PIC seam), pages out of order, heads not a multiple of the tile."""
from __future__ import annotations

import itertools

import pytest
import torch

from hypic.kernels.mla_attention import mla_attention_ref, mla_attention_triton
from kernel_cases import interpreted, rel_err

HEADS, RANK, ROPE, NOPE, V_DIM, BLOCK = 5, 32, 16, 24, 20, 8


def make_case(kv_lens: list[int], query_lens: list[int], seed: int, dtype=torch.float32, device="cpu"):
    """Latent pages (shuffled), per-sequence block tables, and queries at the last query_lens positions."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // BLOCK) for n in kv_lens) + 1
    pages = torch.randn(blocks, BLOCK, 1, RANK + ROPE, generator=g)
    order = torch.randperm(blocks - 1, generator=g) + 1
    tables, used = [], 0
    for n in kv_lens:
        need = -(-n // BLOCK)
        tables.append(order[used:used + need].tolist())
        used += need
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor([p for n, m in zip(kv_lens, query_lens) for p in range(n - m, n)])
    w_uk = torch.randn(HEADS, NOPE, RANK, generator=g) / RANK ** 0.5
    q_nope = torch.randn(positions.numel(), HEADS, NOPE, generator=g)
    q_pe = torch.randn(positions.numel(), HEADS, ROPE, generator=g)
    q_abs = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_pe], -1)
    on = lambda x, dt=None: x.to(device, dt) if dt else x.to(device)  # noqa: E731
    return (on(q_abs, dtype), on(pages, dtype), on(table), on(torch.tensor(kv_lens, dtype=torch.int32)),
            on(positions), tuple(query_lens))


def oracle(q_abs, pages, table, kv_lens, positions, query_lens, scale):
    """Float64 softmax over each sequence's latent rows, causal by position: [N, H, RANK]."""
    out, starts = [], list(itertools.accumulate(query_lens, initial=0))
    for b, n in enumerate(kv_lens.tolist()):
        rows = pages.double()[table[b].long()].flatten(0, 1)[:n, 0]
        for i in range(starts[b], starts[b + 1]):
            visible = rows[: int(positions[i]) + 1]
            p = torch.softmax(q_abs[i].double() @ visible.T * scale, -1)
            out.append(p @ visible[:, :RANK])
    return torch.stack(out)


def cu_of(query_lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32)


CASES = [([70, 9, 33], [1, 1, 1]), ([100, 21], [6, 1]), ([40], [40])]


@pytest.mark.parametrize("kv_lens,query_lens", CASES)
def test_reference_matches_float64_oracle(kv_lens, query_lens) -> None:
    q, pages, table, lens, pos, qlens = make_case(kv_lens, query_lens, seed=len(kv_lens))
    o = mla_attention_ref(q, pages, table, lens, pos, cu_of(qlens), scale=0.2, rank=RANK, seq_lens_cpu=qlens,
                          max_kv_len=max(kv_lens))
    assert o.shape == (pos.numel(), HEADS, RANK)
    assert rel_err(o, oracle(q, pages, table, lens, pos, qlens, 0.2)) <= 1e-5


@interpreted
def test_triton_interpreted_matches_float64_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, pages, table, lens, pos, qlens = make_case([45, 9], [3, 1], seed=7)
    o = mla_attention_triton(q, pages, table, lens, pos, cu_of(qlens), scale=0.2, rank=RANK)
    assert rel_err(o, oracle(q, pages, table, lens, pos, qlens, 0.2)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_lens,query_lens", CASES)
def test_triton_on_gpu_matches_float64_oracle(kv_lens, query_lens, dtype, bound) -> None:
    q, pages, table, lens, pos, qlens = make_case(kv_lens, query_lens, seed=3, dtype=dtype, device="cuda")
    o = mla_attention_triton(q, pages, table, lens, pos, cu_of(qlens).cuda(), scale=0.2, rank=RANK)
    assert rel_err(o.cpu(), oracle(q.cpu(), pages.cpu(), table.cpu(), lens.cpu(), pos.cpu(), qlens, 0.2)) <= bound


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
