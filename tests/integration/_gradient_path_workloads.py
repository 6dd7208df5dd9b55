"""The engine's gradient path on several ranks, run by tests/integration/test_gradient_path.py in one launch.

``direct_*``: a script's own ``loss.backward()`` then ``engine.step()``, against ``engine.backward(loss)``, at
every ZeRO stage in fp32 and bf16, and the steps that must refuse (fp16 after ``loss.backward()``, a step with no
gradient). ``payload_*``: what the data-parallel collectives receive during backward for ``prescale_gradients``
x ``gradient_predivide_factor``, at every stage, and ``engine.allreduce_bucket``'s payload.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

MICRO, GAS, STEPS = 2, 2, 4


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(MICRO, 8, generator=gen), torch.randn(MICRO, 4, generator=gen)


def config(stage: int, gas: int = GAS, optimizer: str = "Adam", lr: float = 1e-2, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
            "optimizer": {"type": optimizer, "params": {"lr": lr}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50,
                                  "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})}, **extra}


def build(cfg: dict[str, Any]) -> Any:
    import dsrun

    net = model()
    engine, _, _, _ = dsrun.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return engine


def loss_of(engine: Any, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    dtype = next(p for p in engine.module.parameters()).dtype
    return F.mse_loss(engine(x.to(dtype)).float(), y)


def weights(engine: Any) -> np.ndarray:
    from dsrun.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return torch.cat([p.detach().reshape(-1).double() for p in params]).numpy()


# --- loss.backward() instead of engine.backward(loss) ------------------------------------------------------------
def direct_run(rank: int, stage: int, precision: str | None, how: str) -> dict[str, Any]:
    extra = {precision: {"enabled": True}} if precision else {}
    engine = build(config(stage, **extra))
    start = weights(engine)
    losses = []
    for micro in range(STEPS * GAS):
        loss = loss_of(engine, micro % GAS, rank)  # the same batches every step: the losses must fall
        losses.append(loss.item())
        if how == "engine":
            engine.backward(loss)
        else:
            loss.backward()
        engine.step()
    result = {"losses": losses, "moved": float(np.abs(weights(engine) - start).max()), "steps": engine.global_steps}
    engine.destroy()
    return result


def refusal(engine: Any, action: Any) -> str | None:
    from dsrun.utils.errors import UserError

    try:
        action()
    except UserError as exc:
        return str(exc)
    return None


def fp16_direct(rank: int, stage: int) -> dict[str, Any]:
    """fp16, ``loss.backward()``: the first ``step()`` refuses, before any update (gas 2: a non-boundary one)."""
    engine = build(config(stage, fp16={"enabled": True, "initial_scale_power": 8}))
    start = weights(engine)
    loss_of(engine, 0, rank).backward()
    message = refusal(engine, engine.step)
    result = {"message": message, "unchanged": bool((weights(engine) == start).all()), "micro": engine.micro_steps}
    engine.destroy()
    return result


def step_without_gradient(rank: int, stage: int) -> dict[str, Any]:
    """One real step, then a forward and a step with no backward: refused, and the weights stay."""
    engine = build(config(stage, gas=1))
    engine.backward(loss_of(engine, 0, rank))
    engine.step()
    after_first = weights(engine)
    loss_of(engine, 1, rank)
    message = refusal(engine, engine.step)
    result = {"message": message, "unchanged": bool((weights(engine) == after_first).all()),
              "steps": engine.global_steps}
    engine.destroy()
    return result


# --- what goes on the wire ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def recorded_payloads(sink: list[float]) -> Iterator[None]:
    """Record the sum of |x| (float64) of every tensor handed to a data-parallel reduction."""
    import dsrun.comm as comm

    originals = {name: getattr(comm, name) for name in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor")}

    def total(tensors: Any) -> float:
        return float(sum(t.detach().double().abs().sum() for t in tensors))

    def all_reduce(tensor, *args, **kwargs):
        sink.append(total([tensor]))
        return originals["all_reduce"](tensor, *args, **kwargs)

    def reduce_scatter(output, inputs, *args, **kwargs):
        sink.append(total(inputs))
        return originals["reduce_scatter"](output, inputs, *args, **kwargs)

    def reduce_scatter_tensor(output, tensor, *args, **kwargs):
        sink.append(total([tensor]))
        return originals["reduce_scatter_tensor"](output, tensor, *args, **kwargs)

    for name, fn in (("all_reduce", all_reduce), ("reduce_scatter", reduce_scatter),
                     ("reduce_scatter_tensor", reduce_scatter_tensor)):
        setattr(comm, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)


def local_gradient_sum(rank: int) -> float:
    """sum |gradient| of this rank's own micro-batch, in plain torch (what the payload divides)."""
    net = model()
    x, y = batch(0, rank)
    F.mse_loss(net(x), y).backward()
    return float(sum(p.grad.double().abs().sum() for p in net.parameters()))


def payload_run(rank: int, stage: int, prescale: bool, factor: float, reduce_scatter: bool) -> dict[str, Any]:
    engine = build(config(stage, gas=1, optimizer="SGD", lr=0.1, zero_allow_untested_optimizer=True,
                          prescale_gradients=prescale,
                          gradient_predivide_factor=factor, zero={"reduce_scatter": reduce_scatter}))
    loss = loss_of(engine, 0, rank)
    sent: list[float] = []
    with recorded_payloads(sent):
        engine.backward(loss)
    engine.step()
    result = {"payload": sum(sent), "collectives": len(sent), "weights": weights(engine)}
    if stage == 0:  # DeepSpeed's helper, the same rule
        bucket_sent: list[float] = []
        with recorded_payloads(bucket_sent):
            mean = engine.allreduce_bucket([torch.full((3,), rank + 1.0)], engine.dp_group)
        result["bucket"] = (sum(bucket_sent), mean.tolist())
    engine.destroy()
    return result


PAYLOAD_STAGES = ((0, True), (1, True), (2, True), (3, True), (1, False), (2, False))  # (stage, reduce_scatter)
COMBOS = ((False, 1.0), (False, 4.0), (True, 1.0), (True, 4.0))  # (prescale_gradients, gradient_predivide_factor)


def gradient_path(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {"local": local_gradient_sum(rank)}
    for stage in (0, 1, 2, 3):
        for precision in (None, "bf16"):
            for how in ("engine", "torch"):
                results[("direct", stage, precision, how)] = direct_run(rank, stage, precision, how)
        results[("no_grad", stage)] = step_without_gradient(rank, stage)
    for stage in (0, 2):
        results[("fp16", stage)] = fp16_direct(rank, stage)
    for stage, scatter in PAYLOAD_STAGES:
        for prescale, factor in COMBOS:
            results[("payload", stage, scatter, prescale, factor)] = payload_run(rank, stage, prescale, factor, scatter)
    return results
