"""Triton kernels that are compiled on first GPU use, so that hypic imports without triton.

A kernel is a plain module-level function marked `@triton_kernel`; its body uses `tl` (and may call
other marked functions of the same module) as usual. The first launch imports triton, binds `tl`
in the defining module and replaces every marked function there by its `triton.jit` version, so
later launches go straight to Triton. Under TRITON_INTERPRET=1 the same kernels run on the CPU.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LazyKernel:
    """A marked function: `kernel[grid](...)` compiles its whole module's kernels, then launches."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return bind_module(self.fn.__globals__)[self.fn.__name__][grid]


def triton_kernel(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


def bind_module(scope: dict[str, Any]) -> dict[str, Any]:
    """A kernel module's globals with its marked functions made `triton.jit` (nothing compiles yet)."""
    import triton
    import triton.language

    scope["tl"] = triton.language
    for name, value in list(scope.items()):
        if isinstance(value, LazyKernel):
            value.fn.__globals__["tl"] = triton.language  # helpers imported from other modules
            scope[name] = triton.jit(value.fn)
    return scope


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
