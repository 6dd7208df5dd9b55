"""Training loops shaped like real DeepSpeed client code, run by tests/integration/test_client_patterns.py.

``gan_*``: DeepSpeedExamples' GAN (training/gan/gan_deepspeed_train.py). Two engines, a discriminator D and
a generator G; every iteration the script clears D's gradients itself (``netD.zero_grad()``), runs two
backward passes through D (real, then fake) before one ``D.step()``, and then the generator's loss flows
back through D's parameters, which are not stepped again, into G. The reference is the same loop in plain
PyTorch on the whole global batch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NOISE, FEATURES, HIDDEN = 4, 6, 12
LR, BETAS = 2e-3, (0.5, 0.999)


def gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    net_d = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1))
    net_g = nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, FEATURES))
    return net_d, net_g


def gan_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    real = torch.randn(size, FEATURES, generator=gen) * 0.5 + 1.0
    noise = torch.randn(size, NOISE, generator=gen)
    return real, noise


def clear_grads(module: nn.Module, how: str) -> None:
    """What the script does to D's gradients at the top of an iteration."""
    if how == "none":  # torch's default zero_grad(): set to None
        module.zero_grad()
    elif how == "zero":
        module.zero_grad(set_to_none=False)
    elif how == "assign":  # gradients replaced by the user's own tensors (a scaled copy of what is there)
        for p in module.parameters():
            if p.grad is not None:
                p.grad = p.grad * 0.5
    else:
        raise ValueError(how)


def gan_iteration(forward_d: Any, backward_d: Any, step_d: Any, forward_g: Any, backward_g: Any, step_g: Any,
                  net_d: nn.Module, net_g: nn.Module, real: torch.Tensor, noise: torch.Tensor, how: str) -> None:
    ones = torch.ones(real.shape[0], 1)
    zeros = torch.zeros(real.shape[0], 1)
    clear_grads(net_d, how)
    backward_d(F.binary_cross_entropy_with_logits(forward_d(real), ones))
    fake = forward_g(noise)
    backward_d(F.binary_cross_entropy_with_logits(forward_d(fake.detach()), zeros))
    step_d()
    net_g.zero_grad()
    backward_g(F.binary_cross_entropy_with_logits(forward_d(fake), ones))  # flows through D, not stepped
    step_g()


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def gan_reference(steps: int, global_size: int, how: str) -> dict[str, Any]:
    net_d, net_g = gan_models()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=LR, betas=BETAS)
    opt_g = torch.optim.Adam(net_g.parameters(), lr=LR, betas=BETAS)
    start = torch.cat([flat(net_d), flat(net_g)])

    def stepper(opt: torch.optim.Optimizer) -> Any:
        def step() -> None:  # DeepSpeed's engine.step(): the update, then the gradients are cleared
            opt.step()
            opt.zero_grad()
        return step

    for step in range(steps):
        real, noise = gan_batch(step, global_size)
        gan_iteration(net_d, lambda loss: loss.backward(), stepper(opt_d), net_g, lambda loss: loss.backward(),
                      stepper(opt_g), net_d, net_g, real, noise, how)
    return {"d": flat(net_d).numpy(), "g": flat(net_g).numpy(), "start": start.numpy()}


def gan_ranks(rank: int, world: int, stage: int, hows: tuple[str, ...], steps: int, micro: int) -> dict[str, Any]:
    """One launch per stage: the GAN loop once per way of clearing D's gradients."""
    return {how: gan_engines(rank, world, stage, how, steps, micro) for how in hows}


def gan_engines(rank: int, world: int, stage: int, how: str, steps: int, micro: int) -> dict[str, Any]:
    import dsrun

    net_d, net_g = gan_models()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=LR, betas=BETAS)
    opt_g = torch.optim.Adam(net_g.parameters(), lr=LR, betas=BETAS)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40,
                                    "stage3_param_persistence_threshold": 0}}
    engine_d, _, _, _ = dsrun.initialize(model=net_d, optimizer=opt_d, config=config)
    engine_g, _, _, _ = dsrun.initialize(model=net_g, optimizer=opt_g, config=config)
    for step in range(steps):
        real, noise = gan_batch(step, micro * world)
        mine = slice(rank * micro, (rank + 1) * micro)
        gan_iteration(engine_d, engine_d.backward, engine_d.step, engine_g, engine_g.backward, engine_g.step,
                      net_d, net_g, real[mine], noise[mine], how)
    from dsrun.zero import GatheredParameters

    with GatheredParameters(list(net_d.parameters()) + list(net_g.parameters())):
        return {"d": flat(net_d).numpy(), "g": flat(net_g).numpy()}

