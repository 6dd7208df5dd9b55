"""``deepspeed.ops.triton_ops.group_gemm_triton``: DeepSpeed's grouped GEMM, a drop-in for ``torch._grouped_mm``'s
2D x 3D case, as torch ops (the package's docstring says why)."""
from __future__ import annotations

import torch

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GROUP_META_BLOCK = 256  # groups per program of DeepSpeed's meta kernel; DeepSpeed's test sizes its case by it


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

