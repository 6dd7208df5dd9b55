"""``deepspeed.ops.triton_ops``: DeepSpeed's Triton ops (``swiglu``, ``group_gemm_triton``) as torch.

DeepSpeed fuses these into Triton kernels on a GPU. Here they are the same arithmetic in torch ops, so they run
wherever torch runs and give a CPU user DeepSpeed's results: ``swiglu`` is ``silu(gate) * up``;
``group_gemm_triton`` multiplies each group of rows of ``mat_a`` by its own matrix of ``mat_b``, accumulating in
fp32 and casting back, as the kernel does (``torch._grouped_mm``'s 2D x 3D case). Both take DeepSpeed's
arguments, refuse what it refuses with its errors, and differentiate through autograd.

``is_triton_available()`` says honestly whether Triton's kernels could run in this process (Triton imports and
its driver finds a device); callers such as the accelerator's ``prefer_triton_grouped_mm`` and DeepSpeed's tests
ask it. ``_triton`` and ``swiglu_triton`` are DeepSpeed's module paths to this one (``dsrun/alias/paths.py``);
``group_gemm_triton`` is a module of its own, as in DeepSpeed (its name is also the function's).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from dsrun.ops.triton_ops.group_gemm_triton import group_gemm_triton

__all__ = ["group_gemm_triton", "is_triton_available", "swiglu"]  # and, read lazily, _TRITON_AVAILABLE, triton, tl



@functools.cache
def _triton_modules() -> tuple[Any, Any]:
    """``(triton, triton.language)`` when Triton imports and its driver has a device target, else ``(None, None)``
    (DeepSpeed's check: ``triton.runtime.driver.active.get_current_target()`` raises without one)."""
    try:
        import triton
        import triton.language as tl

        triton.runtime.driver.active.get_current_target()
    except Exception:  # ImportError, or no GPU driver: Triton cannot run here
        return None, None
    return triton, tl


def is_triton_available() -> bool:
    """True if Triton is importable and its kernels can run on a device of this process."""
    return _triton_modules()[0] is not None


def __getattr__(name: str) -> Any:
    # DeepSpeed's module attributes ``_TRITON_AVAILABLE``, ``triton``, ``tl``: asked when read, not at import
    if name == "_TRITON_AVAILABLE":
        return is_triton_available()
    if name in ("triton", "tl"):
        return _triton_modules()[name == "tl"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation ``silu(gate) * up``, of ``gate``'s shape and dtype. ValueError when ``gate`` and
    ``up`` differ in shape or dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu expects gate and up to have the same shape, got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu expects gate and up to have the same dtype, got {gate.dtype} and {up.dtype}")
    return F.silu(gate) * up
