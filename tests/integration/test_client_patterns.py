"""Real DeepSpeed client code patterns, each against plain PyTorch (issue 17).

The GAN of DeepSpeedExamples clears the discriminator's gradients itself, runs two backward passes through it
before one step, and lets the generator's loss flow back through it without stepping it. Every ZeRO stage must
then apply exactly torch's gradients, whatever the script did to ``.grad`` (set to None, zeroed, replaced).

Tolerance: the engine and the reference compute the same fp32 gradients and differ only in the order the two
ranks' halves are summed (a few fp32 ulps), which Adam's normalised update passes on as ~ulp * lr per step,
far below the rounding of the stored weights themselves. So the weights may differ by the fp32 rounding of
each update: 16 ulps of the largest weight (16 * 2**-23 * max|w|, ~1e-6 here) bounds 6 steps with room to
spare, and is three orders below the defect this guards against, where whole steps were built from
discarded gradients (errors the size of the moves, ~lr = 2e-3).

The models are the harness's ``gan`` and ``readers`` (tests/harness/models.py); the readers' run is a ``Case``
record. One 2-rank launch runs everything (``client_suite``): the GAN loop at each stage, then the readers.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness.launch import Launch
from tests.harness.models import build_model, global_batch
from tests.harness.runs import Case, ds_config, reference_run, world_suite

STEPS, MICRO, WORLD = 6, 4, 2
LR, BETAS = 2e-3, (0.5, 0.999)
HOWS = ("none", "zero", "assign")
STAGES = (0, 1, 2, 3)
READERS_STEPS, READERS_MICRO = 4, 3

# the readers at ZeRO-3, every parameter partitioned; torch's AdamW, unclipped (the reference is torch's: DeepSpeed's
# "Adam" with torch_adam builds torch.optim.AdamW(params, lr), torch's weight decay of 0.01 included)
CASES = [Case("readers", "readers", ds_config(
    3, READERS_MICRO, 1, bucket=100, zero={"allgather_bucket_size": None, "stage3_param_persistence_threshold": 0,
                                           "stage3_prefetch_bucket_size": 50},
    optimizer={"type": "Adam", "params": {"lr": LR, "torch_adam": True}}, steps_per_print=10**6),
    worlds=(WORLD,), steps=READERS_STEPS, destroy=True, evaluate=True)]


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


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, betas=BETAS)


@functools.lru_cache(maxsize=None)
def gan_reference(how: str) -> dict:
    """The GAN loop in plain PyTorch on the whole global batch."""
    gan = build_model("gan")
    opt_d, opt_g = adam(gan.d.parameters()), adam(gan.g.parameters())
    start = torch.cat([flat(gan.d), flat(gan.g)])

    def stepper(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:  # DeepSpeed's engine.step(): the update, then the gradients are cleared
            opt.step()
            opt.zero_grad()
        return step

    for step in range(STEPS):
        real, noise = global_batch("gan", step, MICRO * WORLD)
        gan_iteration(gan.d, lambda loss: loss.backward(), stepper(opt_d), gan.g, lambda loss: loss.backward(),
                      stepper(opt_g), gan.d, gan.g, real, noise, how)
    return {"d": flat(gan.d).numpy(), "g": flat(gan.g).numpy(), "start": start.numpy()}


def gan_engines(rank: int, world: int, stage: int, how: str) -> dict[str, Any]:
    """The GAN loop with two engines (D and G, each with the client's own Adam) on this rank's slices."""
    import dsrun
    from dsrun.zero import GatheredParameters

    gan = build_model("gan")
    config = ds_config(stage, MICRO, 1, bucket=40, zero={"allgather_bucket_size": 40,
                                                         "stage3_param_persistence_threshold": 0},
                       client_optimizer=True, steps_per_print=10**6)
    engine_d, _, _, _ = dsrun.initialize(model=gan.d, optimizer=adam(gan.d.parameters()), config=config)
    engine_g, _, _, _ = dsrun.initialize(model=gan.g, optimizer=adam(gan.g.parameters()), config=config)
    for step in range(STEPS):
        real, noise = global_batch("gan", step, MICRO * world)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        gan_iteration(engine_d, engine_d.backward, engine_d.step, engine_g, engine_g.backward, engine_g.step,
                      gan.d, gan.g, real[mine], noise[mine], how)
    with GatheredParameters(list(gan.d.parameters()) + list(gan.g.parameters())):
        result = {"d": flat(gan.d).numpy(), "g": flat(gan.g).numpy()}
    engine_d.destroy()
    engine_g.destroy()
    return result


def client_suite(rank: int, world: int) -> dict[str, Any]:
    """Rank entry point: the GAN loop at every stage, once per way of clearing D's gradients, then the cases."""
    results: dict[str, Any] = {f"gan/{stage}/{how}": gan_engines(rank, world, stage, how)
                               for stage in STAGES for how in HOWS}
    return {**results, **world_suite(rank, world, CASES)}


LAUNCHES = {"suite": Launch(client_suite, WORLD, timeout=600)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gan_step_pattern_matches_torch(runs, stage: int) -> None:
    ranks = runs["suite"]
    for how in HOWS:
        ref = gan_reference(how)
        scale = np.abs(np.concatenate([ref["d"], ref["g"]]) - ref["start"]).max()
        assert scale > 1e-3  # the weights really moved
        for net in ("d", "g"):
            got = ranks[0][f"gan/{stage}/{how}"][net]
            err = np.abs(got - ref[net]).max()
            assert err <= 16 * 2.0**-23 * np.abs(ref[net]).max(), f"stage {stage}, grads {how}: {net} differs from torch by {err:.3e}"
            np.testing.assert_array_equal(ranks[1][f"gan/{stage}/{how}"][net], got)  # every rank holds the same model


def test_zero3_gathers_parameters_read_outside_their_module(runs) -> None:
    """nn.MultiheadAttention, nn.TransformerEncoderLayer, a parent multiplying by its child's weight and a
    tied head in the root's forward train at ZeRO-3 as in torch, and evaluate through MHA's inference path.
    Losses: the same weights to 16 ulps give the same cross-entropy to ~1e-6 relative; 1e-5 is the bound."""
    case = CASES[0]
    # MHA's inference path in eval: torch._native_multi_head_attention on out_proj.weight
    ref = reference_run("readers", case.steps, case.global_size(WORLD),
                        optimizer=lambda params: torch.optim.AdamW(params, lr=LR), evaluate=True)
    ranks = [rank["readers"] for rank in runs["suite"]]
    got = ranks[0]
    for a, b in zip(got["losses"] + [got["eval"]], ref["losses"] + [ref["eval"]]):
        assert abs(a - b) <= 1e-5 * abs(b), f"loss {a} vs torch {b}"
    assert np.abs(got["params"] - ref["params"]).max() <= 16 * 2.0**-23 * np.abs(ref["params"]).max()
    np.testing.assert_array_equal(ranks[1]["params"], got["params"])
