"""Serving must not compile new Triton kernel variants as batches change (issues 28, 29).

Triton compiles a kernel once per specialisation key: each argument's type, each int's value 1 and
divisibility by 16, each pointer's 16-byte alignment, every constexpr's value and the launch options.
A kernel must therefore see the same key at every batch shape of one compile-time choice (tile, dtype,
flags, whether the KV range is split).

How these tests count: each host wrapper runs at several batch shapes with its kernels replaced by
`Launches`, which runs nothing and computes the key Triton's launcher would for the recorded
arguments: the binder `JITFunction.run` calls (`create_function_from_signature`, Triton's own
specialisation rules) of a JITFunction made from the kernel's function with the options it is marked
with, plus the launch options. CPU only: neither a GPU nor the interpreter (the GPU test beside the
paged-attention kernel tests counts the variants Triton really compiles).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from hypic.kernels import activation, conv1d, gdn_inputs, gdn_tuples, mla_attention, moe, norms, paged_attention
from hypic.kernels.host_copy import packed_offsets
from hypic.kernels.varlen import RowSpans

triton_jit = pytest.importorskip("triton.runtime.jit")
compiler = pytest.importorskip("triton.backends.compiler")


class Launches:
    """Stands in for a kernel: records the specialisation key of each launch, runs nothing."""

    def __init__(self, kernel: object) -> None:
        fn = kernel.fn  # the marked function, whether or not triton has bound the module yet
        jit = triton_jit.JITFunction(fn, **fn.jit_options)
        self.binder = triton_jit.create_function_from_signature(jit.signature, jit.params, compiler.BaseBackend)
        self.names = [p.name for p in jit.params]
        self.keys: set[tuple] = set()

    def __getitem__(self, grid: object) -> Launches:
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        _, specialization, options = self.binder(*args, **kwargs)
        self.keys.add((tuple(specialization), tuple(sorted(options.items()))))

    def assert_variants(self, expected: int) -> None:
        """As many keys as compile-time choices the shapes made; else names what varies."""
        varying = {name: {spec[i] for spec, _ in self.keys} for i, name in enumerate(self.names)}
        varying = {name: entries for name, entries in varying.items() if len(entries) > 1}
        options = {o for _, o in self.keys}
        assert len(self.keys) == expected, f"{len(self.keys)} variants, not {expected}: {varying}, options {options}"


def record(monkeypatch: pytest.MonkeyPatch, module: object, *names: str) -> list[Launches]:
    launches = [Launches(getattr(module, name)) for name in names]
    for name, stand_in in zip(names, launches):
        monkeypatch.setitem(vars(module), name, stand_in)
    return launches


# ----------------------------------------------------------------------------- attention

def paged_batch(kv_lens: list[int], seq_lens: list[int], heads: tuple[int, int] = (4, 2), dim: int = 64,
                page: int = 16) -> dict:
    """Shapes of a step (values unread): a block table as wide as its longest sequence needs."""
    width = max(-(-n // page) for n in kv_lens)
    tokens = sum(seq_lens)
    return dict(q=torch.zeros(tokens, heads[0], dim, dtype=torch.bfloat16),
                k_cache=torch.zeros(sum(-(-n // page) for n in kv_lens), page, heads[1], dim, dtype=torch.bfloat16),
                block_tables=torch.zeros(len(kv_lens), width, dtype=torch.int32),
                kv_lens=torch.tensor(kv_lens, dtype=torch.int32), positions=torch.zeros(tokens, dtype=torch.long),
                cu_seqlens=torch.tensor(list(itertools.accumulate(seq_lens, initial=0)), dtype=torch.int32),
                gate=torch.zeros(tokens, heads[0] * dim, dtype=torch.bfloat16))


@pytest.fixture
def h200_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split rules size their counts for an H200's 132 SMs (the CPU's pretend 4 split little)."""
    for module in (paged_attention, mla_attention):
        monkeypatch.setattr(module, "streaming_multiprocessors", lambda device: 132)


def run_paged(b: dict, first_seq: int, first_token: int, seq_lens: tuple[int, ...]) -> None:
    paged_attention.paged_attention_triton(
        b["q"], b["k_cache"], b["k_cache"], b["block_tables"], b["kv_lens"], b["positions"], b["cu_seqlens"],
        scale=0.1, out=torch.empty_like(b["q"]), first_seq=first_seq, first_token=first_token, seq_lens=seq_lens,
        max_kv_len=int(b["kv_lens"][first_seq:first_seq + len(seq_lens)].max()), gate=b["gate"])


def test_paged_attention_decodes_compile_once_split_or_whole(monkeypatch: pytest.MonkeyPatch, h200_sms: None
                                                             ) -> None:
    """Decode steps of 1 to 33 sequences over 9 to 4000 keys (1 to 31 KV splits): the attention kernel
    in two variants (whole, split), one output gate (of the unsplit steps; on CPU the split ones merge
    in torch, gated there)."""
    (attention,) = record(monkeypatch, paged_attention, "_paged_attention_kernel")
    (gate,) = record(monkeypatch, activation, "_sigmoid_gate_kernel")
    splits = set()
    for batch, longest in itertools.product((1, 2, 3, 16, 17, 33), (9, 130, 1000, 4000)):
        kv_lens = [max(1, longest - 7 * i) for i in range(batch)]
        b = paged_batch(kv_lens, [1] * batch)
        splits.add(paged_attention.Tiling.choose(b["q"], b["k_cache"], (1,) * batch, longest).splits)
        run_paged(b, 0, 0, (1,) * batch)
    assert 1 in splits and len(splits) > 4  # the shapes did change the split count
    attention.assert_variants(2)
    gate.assert_variants(1)


def test_one_merge_serves_every_split_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 to MAX_KV_SPLITS splits of 1 to 33 tokens: one merge, and one gated merge."""
    (merge,) = record(monkeypatch, paged_attention, "_merge_kernel")
    heads, dim = 4, 64
    for splits, tokens in itertools.product((2, 3, 16, 17, paged_attention.MAX_KV_SPLITS), (1, 2, 16, 33)):
        partial = torch.zeros(splits, tokens, heads, dim)
        lse, out = torch.zeros(splits, tokens, heads), torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
        for gate in (None, torch.zeros(tokens, heads * dim, dtype=torch.bfloat16)):
            paged_attention.merge_splits_triton(partial, lse, out, gate)
    merge.assert_variants(2)


def test_paged_attention_prefill_groups_compile_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill group of mixed steps (0 to 5 decodes before it: its first sequence and token move)."""
    (attention,) = record(monkeypatch, paged_attention, "_paged_attention_kernel")
    record(monkeypatch, activation, "_sigmoid_gate_kernel")
    for decodes, prefills in itertools.product((0, 1, 5), ((7,), (16, 3), (1, 40, 17))):
        seq_lens = [1] * decodes + list(prefills)
        b = paged_batch([n + 20 for n in seq_lens], seq_lens)
        run_paged(b, decodes, decodes, tuple(prefills))
    attention.assert_variants(1)


def test_forced_splits_past_the_merge_bound_are_refused() -> None:
    b = paged_batch([4000], [1])
    with pytest.raises(ValueError, match=f"at most {paged_attention.MAX_KV_SPLITS}"):
        paged_attention.Tiling.choose(b["q"], b["k_cache"], (1,), 4000, splits=paged_attention.MAX_KV_SPLITS + 1)


def test_mla_decodes_compile_once_split_or_whole(monkeypatch: pytest.MonkeyPatch, h200_sms: None) -> None:
    """Decode steps over a batch's sequences as the MLA layer passes them (views of the batch's index
    tensors from its first decode on: offsets that move with the step)."""
    (kernel,) = record(monkeypatch, mla_attention, "_mla_kernel")  # its merge (on CPU torch's) is the paged one
    heads, rank, rope, page = 4, 32, 16, 16
    splits = set()
    for skip, batch, longest in itertools.product((0, 1, 3), (1, 2, 5, 16, 17), (100, 700, 1500, 9000)):
        total = skip + batch
        b = paged_batch([longest] * total, [1] * total, heads=(heads, 1), dim=rank + rope, page=page)
        seqs = slice(skip, total)
        q_abs = torch.zeros(batch, heads, rank + rope, dtype=torch.bfloat16)
        cu = b["cu_seqlens"][skip:total + 1]
        splits.add(mla_attention.LatentTiling.choose(q_abs, rank, (1,) * batch, longest).splits)
        mla_attention.mla_attention_triton(q_abs, b["k_cache"], b["block_tables"][seqs], b["kv_lens"][seqs],
                                           b["positions"][skip:total], cu - cu[0], scale=0.1, rank=rank,
                                           seq_lens_cpu=(1,) * batch, max_kv_len=longest)
    assert 1 in splits and len(splits) > 3
    kernel.assert_variants(2)


# ----------------------------------------------------------------------------- linear layers, norms, MoE

ROWS = (1, 2, 3, 16, 17, 100)


def test_conv1d_varlen_compiles_once(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = record(monkeypatch, conv1d, "_conv_varlen_kernel", "_conv_window_kernel", "_conv_decode_kernel")
    dim, width = 64, 4
    weight, pool = torch.zeros(dim, width), torch.zeros(8, dim, width - 1)
    for decodes, prefills in itertools.product((0, 1, 3, 16), ((5,), (1, 30), (16, 17, 2))):
        seq_lens = [1] * decodes + list(prefills)
        x = torch.zeros(sum(seq_lens), dim)
        cu = torch.tensor(list(itertools.accumulate(seq_lens, initial=0)), dtype=torch.int32)
        slots, has_state = torch.arange(len(seq_lens)), torch.ones(len(seq_lens), dtype=torch.bool)
        conv1d.conv1d_varlen_triton(x, weight, None, pool, slots, has_state, cu, "silu", out=torch.empty_like(x),
                                    first_seq=decodes, seq_lens=tuple(prefills))
        if decodes:
            conv1d.conv1d_decode_triton(x[:decodes], weight, None, pool, slots[:decodes], has_state[:decodes], "silu",
                                        out=torch.empty_like(x)[:decodes])
    for launch in launches:
        launch.assert_variants(1)


def test_row_kernels_compile_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels over a step's rows: activations, q/k l2norm, GDN gates, the fused norm."""
    launches = [*record(monkeypatch, activation, "_silu_mul_kernel", "_sigmoid_gate_kernel"),
                *record(monkeypatch, gdn_inputs, "_l2norm_kernel", "_gates_kernel"),
                *record(monkeypatch, norms, "_norm_kernel")]
    heads, dim = 2, 32
    for rows in ROWS:
        activation.silu_and_mul_triton(torch.zeros(rows, 2 * dim))
        activation.sigmoid_gate_triton(torch.zeros(rows, dim), torch.zeros(rows, dim))
        gdn_inputs.qk_l2norm_triton(torch.zeros(rows, 2 * heads * dim), heads, dim)
        gdn_inputs.gdn_gates_triton(torch.zeros(rows, heads), torch.zeros(rows, heads), torch.zeros(heads),
                                    torch.zeros(heads))
        norms.norm_triton(torch.zeros(rows, heads, dim), torch.ones(dim), 1e-6, offset=False)
    for launch in launches:
        launch.assert_variants(1)


def test_span_tuples_compile_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk table's rows are views at offsets set by the step's chunk count."""
    launches = record(monkeypatch, gdn_tuples, "_chunk_factor_kernel", "_ordered_product_kernel")
    heads, dim = 2, 16
    for lens in ((5,), (64, 3), (65, 1, 200), (7, 7, 7, 130)):
        starts = tuple(itertools.accumulate(lens, initial=0))[:-1]
        tokens = sum(lens)
        k = torch.zeros(tokens, heads, dim)
        g, beta = torch.zeros(tokens, heads), torch.zeros(tokens, heads)
        gdn_tuples.gdn_span_tuples_triton(k, k, g, beta, RowSpans.build(starts, lens, "cpu"))
    for launch in launches:
        launch.assert_variants(1)


def test_moe_kernels_compile_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of one expert block size and N tile (float32: blocks of 16; up to 64 pairs: 32 columns),
    and routing batches of one token tile (5 to 8 tokens: the one-program router's tile is the power of
    two above the batch, a bounded choice)."""
    names = ("_route_kernel", "_count_kernel", "_layout_kernel", "_place_kernel", "_moe_gate_up_kernel",
             "_moe_down_kernel", "_combine_kernel", "_route_blocks_kernel")
    launches = record(monkeypatch, moe, *names)
    experts, top_k, hidden, inter = 8, 2, 32, 16
    w_gate_up, w_down = torch.zeros(experts, 2 * inter, hidden), torch.zeros(experts, hidden, inter)
    routing = moe.Routing(top_k=top_k, renormalize=True)
    for tokens in (5, 6, 7, 8):
        logits = torch.zeros(tokens, experts)
        weights, ids = moe.route_topk_triton(logits, top_k, True)
        ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts
        moe.expert_blocks_triton(ids, experts, 16)
        moe.moe_triton(torch.zeros(tokens, hidden), w_gate_up, w_down, weights, ids)
        moe.moe_combine_triton(torch.zeros(tokens * top_k, hidden), weights, None, torch.float32, None)
        moe.route_blocks_triton(logits, routing, 16)
    for launch in launches:
        launch.assert_variants(1)


def test_packed_batch_tensors_start_16_byte_aligned() -> None:
    """Triton specialises on a pointer's 16-byte alignment: every tensor of a packed step copy starts there,
    whatever the sizes before it."""
    for sizes in itertools.product((0, 4, 8, 12, 24, 1000), repeat=3):
        assert all(offset % 16 == 0 for offset in packed_offsets(list(sizes)))
