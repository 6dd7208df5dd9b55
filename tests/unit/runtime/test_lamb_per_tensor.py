"""LAMB without ZeRO partitioning takes one trust ratio per model tensor, as DeepSpeed's per-parameter FusedLamb,
although the engine steps one flat buffer per param group (stage 0 marks the tensors inside it)."""
from __future__ import annotations

import pytest
import torch

import dsrun

pytestmark = pytest.mark.usefixtures("world_of_one")

EPS32 = torch.finfo(torch.float32).eps
LAMB = {"lr": 0.05, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # tensors of very different scales, so one shared trust ratio would move them very differently
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(20.0)
    return model


def _reference_step(params: list[torch.Tensor], grads: list[torch.Tensor], per_tensor: bool) -> list[torch.Tensor]:
    """One LAMB step in float64 from zero moments (bias-corrected: m_hat = g, v_hat = g^2)."""
    lr, (b1, b2), eps, wd = LAMB["lr"], LAMB["betas"], LAMB["eps"], LAMB["weight_decay"]
    ps = [p.double() for p in params]
    updates = []
    for p, g in zip(ps, grads):
        g = g.double()
        m_hat, v_hat = (1 - b1) * g / (1 - b1), (1 - b2) * g * g / (1 - b2)
        updates.append(m_hat / (v_hat.sqrt() + eps) + wd * p)
    if per_tensor:
        trusts = [(p.norm() / u.norm()).clamp(0.01, 10.0) for p, u in zip(ps, updates)]
    else:
        shared = (torch.cat([p.flatten() for p in ps]).norm()
                  / torch.cat([u.flatten() for u in updates]).norm()).clamp(0.01, 10.0)
        trusts = [shared] * len(ps)
    return [p - lr * t * u for p, t, u in zip(ps, trusts, updates)], updates, trusts


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage0_lamb_takes_one_trust_ratio_per_tensor(precision):
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Lamb", "params": LAMB},
              "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}  # the reference takes raw gradients
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine = dsrun.initialize(model=model, config=config)[0]
    start = [p.detach().float().clone() for p in engine.module.parameters()]
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    loss = engine(x.to(next(engine.module.parameters()).dtype)).float().square().mean()
    engine.backward(loss)
    grads = [p.grad.detach().float().clone() for p in engine.module.parameters()]
    engine.step()
    if precision == "fp32":
        after = [p.detach().double() for p in engine.module.parameters()]
    else:  # the fp32 masters (the bf16 weights are their rounding)
        after = [dsrun.utils.safe_get_full_fp32_param(p).double() for p in engine.module.parameters()]
    expected, updates, trusts = _reference_step(start, grads, per_tensor=True)
    shared, _, shared_trusts = _reference_step(start, grads, per_tensor=False)
    assert max(abs(float(t) - float(shared_trusts[0])) / float(t) for t in trusts) > 0.5  # the two rules differ
    for got, want, old, u, t in zip(after, expected, start, updates, trusts):
        n = old.numel()
        # fp32: the update's elementwise arithmetic (a few roundings of lr*t*|u|), the two norms summed over n
        # elements (relative error <= n eps each) and the final add (eps |p|)
        bound = EPS32 * (old.double().abs() + LAMB["lr"] * float(t) * u.abs() * (2 * n + 8))
        assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())
    far = max(float((got - s).abs().max()) for got, s in zip(after, shared))
    assert far > 1e-3  # and the result is nowhere near a single shared trust ratio
