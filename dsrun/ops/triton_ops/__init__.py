"""``deepspeed.ops.triton_ops``: DeepSpeed's Triton ops (``swiglu``, ``group_gemm_triton``) as torch.

DeepSpeed fuses these into Triton kernels on a GPU. Here they are the same arithmetic in torch ops, so they run
wherever torch runs and give a CPU user DeepSpeed's results: ``swiglu`` is ``silu(gate) * up``;
``group_gemm_triton`` multiplies each group of rows of ``mat_a`` by its own matrix of ``mat_b``, accumulating in
fp32 and casting back, as the kernel does (``torch._grouped_mm``'s 2D x 3D case). Both take DeepSpeed's
arguments, refuse what it refuses with its errors, and differentiate through autograd.

``is_triton_available()`` says honestly whether Triton's kernels could run in this process (Triton imports and
its driver finds a device); callers such as the accelerator's ``prefer_triton_grouped_mm`` and DeepSpeed's tests
ask it. ``_triton``, ``swiglu_triton`` and ``group_gemm_triton`` are DeepSpeed's module paths to this one
(``dsrun/alias/paths.py``).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GROUP_META_BLOCK = 256  # groups per program of DeepSpeed's meta kernel; DeepSpeed's test sizes its case by it


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


def _group_meta(offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's first row and row count (int32) from the cumulative boundaries ``offs``."""
    ends = offs.to(torch.int32)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts, ends - starts


def _validate(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor, trans_b: bool) -> None:
    if mat_a.dim() != 2 or mat_b.dim() != 3:
        raise NotImplementedError(f"Only 2D x 3D grouped GEMM is supported, got mat_a.dim()={mat_a.dim()}, "
                                  f"mat_b.dim()={mat_b.dim()}.")
    if not mat_b.is_contiguous():
        raise ValueError("group_gemm_triton requires a contiguous mat_b. To compute a @ b^T, pass the weight in its "
                         "native [E, N, K] layout with trans_b=True instead of a non-contiguous .transpose(-2, -1) "
                         "view.")
    if mat_a.dtype != mat_b.dtype:
        raise ValueError(f"mat_a and mat_b must share dtype, got {mat_a.dtype} vs {mat_b.dtype}.")
    if mat_a.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"Unsupported dtype {mat_a.dtype}; supported: {_SUPPORTED_DTYPES}.")
    if offs.dim() != 1 or offs.shape[0] != mat_b.shape[0]:
        raise ValueError(f"offs must be 1D of length E={mat_b.shape[0]}, got shape {tuple(offs.shape)}.")
    contraction = mat_b.shape[2] if trans_b else mat_b.shape[1]
    if mat_a.shape[1] != contraction:
        raise ValueError(f"Contraction dim mismatch: mat_a K={mat_a.shape[1]} vs mat_b K={contraction}.")


def group_gemm_triton(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor,
                      trans_b: bool = False) -> torch.Tensor:
    """Grouped GEMM, DeepSpeed's drop-in for ``torch._grouped_mm``: group ``g`` owns rows ``offs[g-1]:offs[g]``
    of ``mat_a`` ``[M, K]`` (empty groups allowed; ``offs[-1] == M``) and multiplies them by ``mat_b[g]``, which
    is ``[K, N]`` or, with ``trans_b``, ``[N, K]`` used transposed (an expert weight in its own layout, whose
    gradient then comes back in that layout). Returns ``[M, N]`` in the inputs' dtype, accumulated in fp32.
    ``mat_b`` must be contiguous (pass ``trans_b=True`` rather than a transposed view)."""
    _validate(mat_a, mat_b, offs, trans_b)
    weights = mat_b.transpose(-2, -1) if trans_b else mat_b
    starts, sizes = (t.tolist() for t in _group_meta(offs))
    # every group takes part, empty ones too, so the weight's gradient is defined (zero) for all of them
    parts = [mat_a[start:start + size].float() @ weights[g].float()
             for g, (start, size) in enumerate(zip(starts, sizes))]
    out = torch.cat(parts) if parts else mat_a.new_zeros(0, weights.shape[2], dtype=torch.float32)
    return out.to(mat_a.dtype)

