"""Counting what a GPU code path launches, on the CPU: meta tensors that say they are CUDA ones (real
shapes, dtypes and code path; no data, no GPU) and a dispatch mode that counts their aten ops with the
bytes they read and write (from the shapes; views and allocations launch nothing), into one tally per
named part. `cuda_step` goes further for whole model steps: every tensor says it lives on a CUDA
device (so the kernels take their GPU branches), and each Triton launch is counted instead of run.
Used by capture_cost.py, decode_ops.py and segment_cost.py.
"""
from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hypic.kernels.triton_lazy import LazyKernel

DTYPE = torch.bfloat16
GPU = "meta"
FREE_OPS = {"aten.lift_fresh.default", "prim.device.default"}  # bookkeeping, no kernel
CUDA = torch.device("cuda", 0)
H200 = {"capability": (9, 0), "multi_processor_count": 132}  # what the kernels ask torch.cuda about


def launches_work(func) -> bool:
    """Whether an aten op moves data (views, allocations and bookkeeping launch nothing)."""
    name = str(func)
    return not (func.is_view or name in FREE_OPS or name.startswith(("aten.empty", "aten._unsafe_view")))


class CudaLike(torch.Tensor):
    """A meta tensor the code takes for a CUDA one (the ops computed from it are CudaLike too)."""

    is_cuda = property(lambda self: True)


class OnCuda(CudaLike):
    """A CudaLike whose device says CUDA too, so device dispatch (`x.device.type == "cuda"`) takes
    the GPU branch; `cuda_step` keeps the tensors made on that device meta ones."""

    device = property(lambda self: CUDA)


def gpu_empty(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=GPU).as_subclass(CudaLike)


class OpTally:
    """One part's aten ops (count and bytes read and written per op), dtype conversions and Triton
    launches (count and programs per kernel; their bytes are not counted: their arguments are whole
    pools and stacked expert weights, of which they read the rows their indices pick)."""

    def __init__(self) -> None:
        self.ops: collections.Counter = collections.Counter()
        self.bytes: dict[str, list[int]] = {}  # per op: bytes read, written
        self.read = self.written = self.conversions = 0
        self.kernels: collections.Counter = collections.Counter()
        self.programs: collections.Counter = collections.Counter()

    def add_op(self, name: str, read: int, written: int, conversions: int) -> None:
        self.ops[name] += 1
        self.bytes[name] = [a + b for a, b in zip(self.bytes.get(name, (0, 0)), (read, written))]
        self.read, self.written = self.read + read, self.written + written
        self.conversions += conversions

    def add_launch(self, name: str, grid: tuple) -> None:
        self.kernels[name] += 1
        self.programs[name] += math.prod(grid)

    def summary(self) -> dict:
        by_op = {name: {"calls": count, "MB_read": round(self.bytes[name][0] / 1e6, 2),
                        "MB_written": round(self.bytes[name][1] / 1e6, 2)} for name, count in self.ops.most_common()}
        by_kernel = {name: {"launches": count, "programs": self.programs[name]}
                     for name, count in self.kernels.most_common()}
        return {"ops": sum(self.ops.values()), "bytes_read": self.read, "bytes_written": self.written,
                "dtype_conversions": self.conversions, "by_op": by_op,
                "triton_launches": sum(self.kernels.values()), "by_kernel": by_kernel}


class OpCounter(TorchDispatchMode):
    """Counts every aten op that launches work (views excluded), with the bytes it reads and writes,
    into `tally` (swap it to count parts apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.tally = OpTally()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = _plain(args), _plain(kwargs or {})  # torch's meta functions must see meta
        out = func(*args, **kwargs)
        name = str(func)
        inputs = _tensors(list(args)) + _tensors([v for key, v in kwargs.items() if key != "out"])
        outputs = _tensors([out])
        if not launches_work(func) or not any(t.device.type == GPU for t in inputs + outputs):
            return out  # host tensors' ops (tables built once, on first use) launch no kernel
        self.tally.add_op(name, _read_bytes(name, inputs, outputs), _written_bytes(name, inputs, outputs),
                          _converts(name, inputs, outputs))
        return out

    def summary(self) -> dict:
        return self.tally.summary()


class _MetaForCuda(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on meta, and every tensor result says CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(_meta_device(a) for a in args)
        kwargs = {key: _meta_device(value) for key, value in (kwargs or {}).items()}
        return _on_cuda(func(*args, **kwargs))


@contextlib.contextmanager
def cuda_step(counter: OpCounter) -> Iterator[None]:
    """Runs a GPU code path on meta tensors: aten ops go to `counter`, each Triton launch to its
    tally instead of the GPU, and torch.cuda's device queries answer as an H200."""
    saved = (LazyKernel.__getitem__, torch.cuda.get_device_capability, torch.cuda.get_device_properties)
    LazyKernel.__getitem__ = lambda kernel, grid: _Launch(counter, kernel.fn.__name__, grid)
    torch.cuda.get_device_capability = lambda device=None: H200["capability"]
    torch.cuda.get_device_properties = lambda device=None: _Properties(**H200)
    try:
        with _MetaForCuda(), counter:
            yield
    finally:
        LazyKernel.__getitem__, torch.cuda.get_device_capability, torch.cuda.get_device_properties = saved


def on_cuda(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor (a model's parameter, a cache) as one on the GPU."""
    return t.as_subclass(OnCuda)


class _Launch:
    def __init__(self, counter: OpCounter, name: str, grid: tuple) -> None:
        self.counter, self.name, self.grid = counter, name, grid

    def __call__(self, *args, **kwargs) -> None:
        self.counter.tally.add_launch(self.name, self.grid)


class _Properties:
    def __init__(self, capability: tuple[int, int], multi_processor_count: int) -> None:
        self.major, self.minor = capability
        self.multi_processor_count = multi_processor_count


def _meta_device(value):
    if isinstance(value, torch.device) and value.type == "cuda" or isinstance(value, str) and value.startswith("cuda"):
        return torch.device(GPU)
    return value


def _on_cuda(value):
    if isinstance(value, torch.Tensor) and not isinstance(value, OnCuda) and value.device.type == GPU:
        return value.as_subclass(OnCuda)
    if type(value) is tuple:
        return tuple(map(_on_cuda, value))
    if isinstance(value, tuple):  # a named tuple, or one of torch's return types (topk's values, indices)
        return type(value)(*map(_on_cuda, value)) if hasattr(value, "_fields") else type(value)(map(_on_cuda, value))
    if isinstance(value, list):
        return [_on_cuda(v) for v in value]
    return value


def _plain(value):
    """OnCuda tensors as the meta tensors they are (torch's functions rewrap their results)."""
    if isinstance(value, OnCuda):
        return value.as_subclass(torch.Tensor)
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    return value


def _tensors(values: list) -> list[torch.Tensor]:
    flat = []
    for value in values:
        if isinstance(value, torch.Tensor):
            flat.append(value)
        elif isinstance(value, (list, tuple)):
            flat += _tensors(list(value))
    return flat


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _read_bytes(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Gathers read as many source bytes as they write (plus the index); a copy reads its source only."""
    if name.startswith("aten.index_copy"):  # (target, dim, index, source): the rows it writes
        return _nbytes(inputs[1]) + _nbytes(inputs[2])
    if name.startswith(("aten.index", "aten.gather")):
        return sum(_nbytes(t) for t in outputs) + sum(_nbytes(t) for t in inputs[1:])
    if name.startswith("aten.embedding"):  # (weight, ids): the rows it picks
        return sum(_nbytes(t) for t in outputs) + _nbytes(inputs[1])
    if name.startswith("aten.copy_"):
        return _nbytes(inputs[1])
    return sum(_nbytes(t) for t in inputs)


def _written_bytes(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    if name.startswith("aten.index_copy"):  # in place: only the indexed rows change
        return _nbytes(inputs[2])
    return sum(_nbytes(t) for t in outputs)


def _converts(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    if name.startswith("aten._to_copy") or name.startswith("aten.copy_"):
        source = inputs[1] if name.startswith("aten.copy_") else inputs[0]
        return int(source.dtype != outputs[0].dtype)
    return 0
