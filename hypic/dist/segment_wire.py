"""Segments, tuples and keys on the wire: a tuple travels as a flat list of tensors plus a small meta
record (interior span and layer counts); the combine node sizes its destination from the model's
segment layout and the segment's interior before the tuple is even built.
"""
from __future__ import annotations

import msgspec
import torch

from hypic.cache.segment_store import SegmentKey, SegmentLayout, SegmentTuple
from hypic.dist.messages import KeyRef, PlannedJob, TensorSpec
from hypic.engine.pic.plan import SegmentJob


class TupleMeta(msgspec.Struct, frozen=True, array_like=True):
    interior: tuple[int, int]
    num_linear: int
    num_full: int
    num_values: int  # V tensors: num_full, or 0 where K is V (MLA latents)


def key_ref(key: SegmentKey) -> KeyRef:
    return KeyRef(key.digest, key.salt)


def key_of(ref: KeyRef) -> SegmentKey:
    return SegmentKey(ref.digest, ref.salt)


def planned_job(job: SegmentJob, *, with_tokens: bool = True) -> PlannedJob:
    tokens = tuple(job.token_ids) if with_tokens else ()
    return PlannedJob(key_ref(job.key), tokens, tuple(job.interior), job.identity_T, job.tier)


def segment_job(planned: PlannedJob) -> SegmentJob:
    return SegmentJob(key_of(planned.key), tuple(planned.token_ids), tuple(planned.interior), planned.identity_T,
                      planned.tier)


def tuple_tensors(tup: SegmentTuple) -> list[torch.Tensor]:
    """[T..., S0..., conv_tail... (one per linear layer), K..., V... (one per full layer)]."""
    return [*tup.T, *tup.S0, *tup.conv_tail, *tup.K, *tup.V]


def tuple_meta(tup: SegmentTuple) -> bytes:
    return msgspec.msgpack.encode(TupleMeta(tuple(tup.interior), len(tup.T), len(tup.K), len(tup.V)))


def tuple_from(tensors: list[torch.Tensor], meta: bytes) -> SegmentTuple:
    info = msgspec.msgpack.decode(meta, type=TupleMeta)
    n_lin, n_full = info.num_linear, info.num_full
    expected = 3 * n_lin + n_full + info.num_values
    if len(tensors) != expected:
        raise ValueError(f"a segment tuple of {n_lin} linear and {n_full} full layers ({info.num_values} V) has "
                         f"{expected} tensors, got {len(tensors)}")
    lin = [tensors[i * n_lin: (i + 1) * n_lin] for i in range(3)]
    full = tensors[3 * n_lin:]
    return SegmentTuple(info.interior, lin[0], lin[1], lin[2], full[:n_full], full[n_full:])


def tuple_specs(layout: SegmentLayout, interior_len: int) -> list[TensorSpec]:
    """The shapes and dtypes `tuple_tensors` gives for a tuple stored in this layout."""
    def spec(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(str(dtype).removeprefix("torch."), tuple(shape))

    kv = spec(layout.model_dtype, (interior_len, layout.kv_heads, layout.head_dim))
    return ([spec(layout.block_dtype(block, i), layout.block_shape(block, i))
             for block in range(3) for i in range(layout.num_linear)] + [kv] * (layout.kv_tensors * layout.num_full))
