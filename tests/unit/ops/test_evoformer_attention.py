"""DeepSpeed4Science's Evoformer attention in torch: the output and the written-out backward (Q, K, V, both biases)
against autograd through the plain formula in float64. The kernel computes in float32 over sums of ``seq`` and
``dim`` terms of order 1, so it is within float32's relative 2**-24 times a few dozen of the exact value."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsrun.alias.paths import target_of
from dsrun.ops.deepspeed4science import DS4Sci_EvoformerAttention


def test_forward_and_backward_match_the_formula():
    gen = torch.Generator().manual_seed(0)
    batch, n, seq, heads, dim = 1, 2, 5, 3, 4
    q, k, v = (torch.randn(batch, n, seq, heads, dim, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.randint(0, 2, (batch, n, 1, 1, seq), generator=gen).float()
    mask[..., 0] = 1  # every row attends somewhere
    bias1 = (1e9 * (mask - 1)).requires_grad_()
    bias2 = torch.randn(batch, 1, heads, seq, seq, generator=gen, requires_grad=True)
    grad = torch.randn(batch, n, seq, heads, dim, generator=gen)

    out = DS4Sci_EvoformerAttention(q, k, v, [bias1, bias2])
    out.backward(grad)
    ours = [out.detach()] + [t.grad.clone() for t in (q, k, v, bias1, bias2)]

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias1, bias2)]
    qd, kd, vd, b1, b2 = leaves
    scores = qd.transpose(-2, -3) @ kd.transpose(-2, -3).transpose(-1, -2) / dim**0.5 + b1 + b2
    exact = (F.softmax(scores, dim=-1) @ vd.transpose(-2, -3)).transpose(-2, -3)
    exact.backward(grad.double())
    for mine, ref in zip(ours, [exact.detach()] + [t.grad for t in leaves]):
        assert mine.shape == ref.shape and torch.allclose(mine.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias2 has shape"):
        DS4Sci_EvoformerAttention(q, k, v, [None, bias2[..., :4]])
    # no biases: plain attention per (batch, n, head)
    plain = DS4Sci_EvoformerAttention(q.detach(), k.detach(), v.detach(), [])
    ref = F.scaled_dot_product_attention(*(t.detach().transpose(-2, -3) for t in (q, k, v))).transpose(-2, -3)
    assert torch.allclose(plain, ref, rtol=1e-5, atol=1e-6)
    assert target_of("deepspeed.ops.deepspeed4science") == "dsrun.ops.deepspeed4science"
