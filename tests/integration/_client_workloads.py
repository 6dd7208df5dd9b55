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
                                    "stage3_param_persistence_threshold": 0},
              "gradient_clipping": 0.0}  # the reference is the plain torch loop, unclipped
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


# --- modules that read a child's parameters in their own forward (ZeRO-3 must gather them) ---------------
VOCAB, WIDTH, SEQ = 11, 8, 5


class ProjectionHead(nn.Module):
    """A parameterless parent that multiplies by its child's weight instead of calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.t() + self.proj.bias


class ChildReaders(nn.Module):
    """``nn.MultiheadAttention`` (reads ``out_proj.weight`` in its own forward), a TransformerEncoderLayer
    (an MHA inside), a parameterless parent reading its child's weight, and a tied output head written as
    ``F.linear(h, self.emb.weight)`` in the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        # no attention biases: a key bias has an exactly-zero true gradient, which Adam would turn from
        # rounding noise into full-size steps that differ between any two summation orders
        self.mha = nn.MultiheadAttention(WIDTH, 2, batch_first=True, bias=False)
        self.enc = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True, bias=False)
        self.head = ProjectionHead()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        y, _ = self.mha(x, x, x, need_weights=False)
        h = self.head(self.enc(x + y))
        logits = F.linear(h, self.emb.weight)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))


def readers_model() -> nn.Module:
    torch.manual_seed(11)
    return ChildReaders()


def readers_batch(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(900 + step))


def readers_reference(steps: int, global_size: int) -> dict[str, Any]:
    model = readers_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = model(readers_batch(step, global_size))
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():  # MHA's inference path: torch._native_multi_head_attention on out_proj.weight
        eval_loss = model(readers_batch(steps, global_size)).item()
    return {"losses": losses, "eval": eval_loss, "params": flat(model).numpy()}


def readers_ranks(rank: int, world: int, steps: int, micro: int) -> dict[str, Any]:
    import dsrun
    from dsrun import comm

    model = readers_model()
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": 100, "stage3_prefetch_bucket_size": 50},
              "gradient_clipping": 0.0}  # the reference is torch's unclipped Adam
    engine, _, _, _ = dsrun.initialize(model=model, config=config)
    mine = slice(rank * micro, (rank + 1) * micro)
    losses = []
    for step in range(steps):
        loss = engine(readers_batch(step, micro * world)[mine])
        engine.backward(loss)
        engine.step()
        total = loss.detach().double().reshape(1)
        comm.all_reduce(total)
        losses.append(total.item() / world)
    engine.eval()
    with torch.no_grad():
        total = engine(readers_batch(steps, micro * world)[mine]).double().reshape(1)
    comm.all_reduce(total)
    from dsrun.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        params = flat(model).numpy()
    return {"losses": losses, "eval": total.item() / world, "params": params}
