"""Tiled compute over the sequence (DeepSpeed's ALST ``TiledMLP``, ``sequence_tiled_compute``,
``TiledFusedLogitsLoss``): the same output and gradients as the untiled block, slice by slice."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.sequence.tiled_compute import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from dsrun.utils import safe_get_full_grad

# float64: the tiled and untiled sums differ only in their order, a few ulps of values ~1
TOL = dict(rtol=0, atol=1e-12)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).double()


def _grads(run, module: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor | None = None):
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    out = run(module, x)
    out.backward(upstream)
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("form", ["TiledMLP", "sequence_tiled_compute"])
def test_tiled_mlp_matches_the_whole_sequence(form):
    mlp = _mlp()
    x = torch.randn(2, 13, 8, dtype=torch.float64)  # 13 over 4 slices: the last one shorter
    upstream = torch.randn(2, 13, 8, dtype=torch.float64)
    tiled = {"TiledMLP": lambda m, x: TiledMLP.apply(lambda self, h: self(h), m, x, 4, list(m.parameters())),
             "sequence_tiled_compute": lambda m, x: sequence_tiled_compute(lambda self, x: self(x), 13, 4, {"x": x},
                                                                           {"self": m}, "x", None, 1, None)}[form]
    whole = _grads(lambda m, x: m(x), mlp, x, upstream)
    for got, expected in zip(_grads(tiled, mlp, x, upstream), whole):
        torch.testing.assert_close(got, expected, **TOL)


def test_sequence_tiled_compute_reduces_scalar_slices_as_the_whole():
    mlp = _mlp()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    tiled = _grads(lambda m, x: sequence_tiled_compute(lambda self, x: self(x).square().mean(), 12, 3, {"x": x},
                                                       {"self": m}, "x", None, 0, "mean"), mlp, x)
    whole = _grads(lambda m, x: m(x).square().mean(), mlp, x)  # equal slices: the mean of means is the mean
    for got, expected in zip(tiled, whole):
        torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_logits_loss_never_makes_the_whole_logits(reduction):
    head = torch.nn.Linear(8, 50).double()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    y = torch.randint(0, 50, (2, 10))
    widest = []

    def loss(self, h, labels):
        logits = self(h)
        widest.append(logits.shape[0])
        return torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)

    tiled = _grads(lambda m, x: TiledFusedLogitsLoss.apply(loss, m, x, y, None, 4, [m.weight], reduction), head, x)
    assert max(widest) == 5  # 20 tokens in 4 slices: at most 5 rows of logits at once
    # equal slices: the mean of the slices' means is the mean over all tokens
    whole = _grads(lambda m, x: loss(m, x.reshape(-1, 8), y.reshape(-1)), head, x)
    for got, expected in zip(tiled, whole):
        torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_reduces_the_gradients_the_slices_accumulate(stage):
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    x = torch.randn(2, 13, 8, requires_grad=True)  # fp32, as the engine trains; a hidden state (needs grad)
    results = []
    for run in (lambda m, x: m(x), lambda m, x: TiledMLP.apply(lambda self, h: self(h), m, x, 4, list(m.parameters()))):
        engine = dsrun.initialize(model=_mlp(), config=config)[0]
        engine.backward(run(engine.module, x).square().sum())
        results.append([safe_get_full_grad(p) for p in engine.module.parameters()])
    for got, expected in zip(*results):  # fp32 sums over 26 tokens x 32 units reordered: < 26*32 ulps of ~1
        torch.testing.assert_close(got, expected, rtol=0, atol=26 * 32 * 1.2e-7)
