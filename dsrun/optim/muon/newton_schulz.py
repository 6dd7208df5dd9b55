"""Muon's arithmetic, as DeepSpeed's ``runtime/zero/muon/original_muon.py`` computes it (after Keller Jordan's
Muon): the Newton-Schulz orthogonalisation, the momentum/Nesterov update around it and the auxiliary Adam update.

``muon_update(grad, momentum)``: ``momentum = beta * momentum + (1 - beta) * grad``; the Nesterov direction
``(1 - beta) * grad + beta * momentum`` (written into ``grad``); its orthogonalisation by five Newton-Schulz steps
of the quintic ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, on the
matrix scaled to Frobenius norm 1 (the wide side last); the result times ``sqrt(max(1, rows / cols))``.

``ns_method`` ``"gram"`` (DeepSpeed's default) iterates on the small Gram matrix ``R = X X^T`` for a wide
matrix (fewer FLOPs, the same polynomial in exact arithmetic, restarted once after two steps); ``"standard"``
iterates on ``X``. The dtype the iteration runs in is DeepSpeed's: bf16 (``standard``) or fp16 (``gram``) where
the accelerator supports it (the CPU does), else fp32. :data:`NEWTON_SCHULZ_DTYPE` overrides that for every
method (a reference computed in fp32 or float64 sets it: tests, ``benchmarks/muon_vs_adamw.py``).
"""
from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
GRAM_RESTART_AT = 2
# None: DeepSpeed's rule (bf16 / fp16 where supported); a dtype: the iteration runs in it whatever the method
NEWTON_SCHULZ_DTYPE: torch.dtype | None = None


def newton_schulz_dtype(method: str) -> torch.dtype:
    """The dtype the ``method`` iteration computes in (see the module docstring)."""
    if NEWTON_SCHULZ_DTYPE is not None:
        return NEWTON_SCHULZ_DTYPE
    from dsrun.accelerator import get_accelerator

    accelerator = get_accelerator()
    if method == "gram":
        return torch.float16 if accelerator.is_fp16_supported() else torch.float32
    return torch.bfloat16 if accelerator.is_bf16_supported() else torch.float32


def _normalised(G: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``G`` in ``dtype``, transposed so that its rows are the short side, scaled to Frobenius norm <= 1."""
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    return X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7), tall


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on ``G`` (>= 2 dims; batched over the leading ones): roughly
    ``U S' V^T`` with ``S'`` near 1, for ``G = U S V^T``."""
    assert G.ndim >= 2
    a, b, c = NS_COEFFICIENTS
    X, tall = _normalised(G, newton_schulz_dtype("standard"))
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


def zeropower_via_gram_newtonschulz(G: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The same polynomial iterated on the Gram matrix ``R = X X^T`` (``n x n``, ``n`` the short side): the
    iterate is ``Q X`` with ``Q`` accumulated from ``R``; restarted (``X <- Q X``) before step
    :data:`GRAM_RESTART_AT` to keep half precision stable. A square matrix takes the standard iteration."""
    assert G.ndim >= 2
    a, b, c = NS_COEFFICIENTS
    X, tall = _normalised(G, newton_schulz_dtype("gram"))
    n, m = X.size(-2), X.size(-1)
    if m <= n:
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X
        return X.mT if tall else X
    R = X @ X.mT
    Q: torch.Tensor | None = None
    for i in range(steps):
        if i == GRAM_RESTART_AT and Q is not None:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and i + 1 != GRAM_RESTART_AT:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return X.mT @ Q.mT if tall else Q @ X


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = NS_STEPS,
                nesterov: bool = True, ns_method: str = "gram", is_expert_group: bool = False) -> torch.Tensor:
    """Muon's update for one matrix (DeepSpeed's ``muon_update``): updates ``momentum`` in place (and, with
    ``nesterov``, overwrites ``grad`` with the Nesterov direction); returns the orthogonalised update in
    ``grad``'s dtype and shape. ``is_expert_group``: a stack of expert matrices, orthogonalised one by one.
    A 4-D convolution filter is viewed as ``out x (in * kh * kw)``."""
    orig_dtype = grad.dtype
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    ns = zeropower_via_gram_newtonschulz if ns_method == "gram" else zeropower_via_newtonschulz5
    if not is_expert_group and update.ndim == 4:
        update = update.view(len(update), -1)
    scale = max(1, grad.size(-2) / grad.size(-1)) ** 0.5  # DeepSpeed's: the gradient's last two dimensions
    update = ns(update, steps=ns_steps) * scale
    return update.to(orig_dtype)


def adam_update(grad: torch.Tensor, buf1: torch.Tensor, buf2: torch.Tensor, step: int,
                betas: tuple[float, float], eps: float) -> torch.Tensor:
    """The auxiliary Adam's direction (DeepSpeed's ``adam_update``): moments by ``lerp``, both bias-corrected,
    ``eps`` added outside the square root."""
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    return (buf1 / (1 - betas[0] ** step)) / ((buf2 / (1 - betas[1] ** step)).sqrt() + eps)
