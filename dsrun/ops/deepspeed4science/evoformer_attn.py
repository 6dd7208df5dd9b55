"""DeepSpeed4Science's Evoformer attention (``DS4Sci_EvoformerAttention``, AlphaFold's MSA/pair attention) in torch.

``Q``, ``K``, ``V`` are ``[batch, n, seq, heads, dim]``; the output is ``softmax(Q Kᵀ / sqrt(dim) + bias1 + bias2) V``
per ``(batch, n, head)``, with ``bias1`` ``[batch, n, 1, 1, seq]`` (the MSA mask, shared by heads and queries) and
``bias2`` ``[batch, 1, heads, seq, seq]`` (the pair bias, shared by the ``n`` rows), either one optional. DeepSpeed
runs this as a CUTLASS kernel (``EvoformerAttnBuilder``, CUDA only); here the same forward and backward are torch
ops on any device: the scores and softmax in float32, the output in the inputs' dtype, and the backward recomputes
the probabilities from the saved log-sum-exp as the kernel does (gradients for ``Q``, ``K``, ``V`` and each bias).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

_F32 = torch.float32


def _probabilities(q: torch.Tensor, k: torch.Tensor, bias1: Optional[torch.Tensor],
                   bias2: Optional[torch.Tensor]) -> torch.Tensor:
    """The float32 attention scores ``[batch, n, heads, seq_q, seq_k]`` (biases added)."""
    scores = torch.einsum("bnqhd,bnkhd->bnhqk", q.to(_F32), k.to(_F32)) * q.shape[-1] ** -0.5
    for bias in (bias1, bias2):
        if bias is not None:
            scores = scores + bias.to(_F32)
    return scores


class EvoformerFusedAttention(torch.autograd.Function):
    """The attention with its backward written out (the kernel's): ``apply(q, k, v, bias1=None, bias2=None)``."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias1: Optional[torch.Tensor] = None,
                bias2: Optional[torch.Tensor] = None) -> torch.Tensor:
        scores = _probabilities(q, k, bias1, bias2)
        lse = scores.logsumexp(dim=-1, keepdim=True)
        out = torch.einsum("bnhqk,bnkhd->bnqhd", (scores - lse).exp(), v.to(_F32)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, bias1, bias2)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, bias1, bias2 = ctx.saved_tensors
        probs = (_probabilities(q, k, bias1, bias2) - lse).exp()
        d_out = grad_out.to(_F32)
        d_v = torch.einsum("bnhqk,bnqhd->bnkhd", probs, d_out)
        d_probs = torch.einsum("bnqhd,bnkhd->bnhqk", d_out, v.to(_F32))
        # softmax backward: dS = P (dP - rowsum(dO * O))
        delta = torch.einsum("bnqhd,bnqhd->bnhq", d_out, out.to(_F32)).unsqueeze(-1)
        d_scores = probs * (d_probs - delta)
        scale = q.shape[-1] ** -0.5
        d_q = torch.einsum("bnhqk,bnkhd->bnqhd", d_scores, k.to(_F32)) * scale
        d_k = torch.einsum("bnhqk,bnqhd->bnkhd", d_scores, q.to(_F32)) * scale
        d_bias1 = d_scores.sum(dim=(2, 3), keepdim=True).to(bias1.dtype) \
            if bias1 is not None and ctx.needs_input_grad[3] else None
        d_bias2 = d_scores.sum(dim=1, keepdim=True).to(bias2.dtype) \
            if bias2 is not None and ctx.needs_input_grad[4] else None
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), d_bias1, d_bias2


def DS4Sci_EvoformerAttention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,  # noqa: N802,N803 (DeepSpeed's)
                              biases: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """Evoformer attention of ``Q``, ``K``, ``V`` (``[batch, n, seq, heads, dim]``) with up to two ``biases``:
    ``[bias1]`` or ``[bias1, bias2]`` (None for one left out), shaped as the module docstring says."""
    if len(biases) > 2:
        raise ValueError(f"DS4Sci_EvoformerAttention: {len(biases)} biases; expected at most 2 (mask, pair bias)")
    bias1, bias2 = (list(biases) + [None, None])[:2]
    batch, n, seq, heads, _ = Q.shape
    for name, bias, shape in (("bias1", bias1, (batch, n, 1, 1, seq)), ("bias2", bias2, (batch, 1, heads, seq, seq))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"DS4Sci_EvoformerAttention: {name} has shape {tuple(bias.shape)}; expected {shape}")
    return EvoformerFusedAttention.apply(Q, K, V, bias1, bias2)
