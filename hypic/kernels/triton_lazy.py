"""Triton kernels that are compiled on first GPU use, so that hypic imports without triton.

A kernel is a plain module-level function marked `@triton_kernel`; its body uses `tl` (and may call
other marked functions of the same module) as usual. The first launch imports triton, binds `tl`
in the defining module and replaces every marked function there by its `triton.jit` version, so
later launches go straight to Triton. Under TRITON_INTERPRET=1 the same kernels run on the CPU.

Triton compiles a kernel again for every new specialisation key: each int argument's value 1 and
divisibility by 16, each pointer's 16-byte alignment, each constexpr's value. A kernel that takes
values changing from step to step (token and sequence counts, first rows, a block table's width,
index views at step-dependent offsets) names them in `@triton_kernel(do_not_specialize=...,
do_not_specialize_on_alignment=...)`, so that one compiled variant serves every batch. Model
constants (head dims, strides of projections) stay specialised: their divisibility is what lets
loads vectorise.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class LazyKernel:
    """A marked function: `kernel[grid](...)` compiles its whole module's kernels, then launches."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return bind_module(self.fn.__globals__)[self.fn.__name__][grid]


def triton_kernel(fn: Callable[..., Any] | None = None, *, do_not_specialize: Sequence[str] = (),
                  do_not_specialize_on_alignment: Sequence[str] = ()) -> Any:
    """`@triton_kernel`, or `@triton_kernel(do_not_specialize=(names...))` for a kernel taking per-step
    values. The options ride on the function itself (`jit_options`), which every later form of the
    kernel (this mark, its `triton.jit` or interpreted version) keeps as `.fn`."""
    def mark(f: Callable[..., Any]) -> LazyKernel:
        names = set(_parameters(f))
        unknown = (set(do_not_specialize) | set(do_not_specialize_on_alignment)) - names
        if unknown:
            raise TypeError(f"{f.__name__} has no parameters {sorted(unknown)} to leave unspecialised")
        f.jit_options = {"do_not_specialize": tuple(do_not_specialize),
                         "do_not_specialize_on_alignment": tuple(do_not_specialize_on_alignment)}
        return LazyKernel(f)
    return mark if fn is None else mark(fn)


def _parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    return fn.__code__.co_varnames[: fn.__code__.co_argcount]


def bind_module(scope: dict[str, Any]) -> dict[str, Any]:
    """A kernel module's globals with its marked functions made `triton.jit` (nothing compiles yet)."""
    import triton
    import triton.language

    scope["tl"] = triton.language
    for name, value in list(scope.items()):
        if isinstance(value, LazyKernel):
            value.fn.__globals__["tl"] = triton.language  # helpers imported from other modules
            scope[name] = triton.jit(value.fn, **value.fn.jit_options)
    return scope


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
