"""The engine's gradient path on 2 gloo ranks, one launch (issue 36, items 1 and 4).

**A script's own ``loss.backward()``** then ``engine.step()`` trains as ``engine.backward(loss)`` does, at ZeRO
stages 0-3 in fp32 and bf16. Bound: the two runs differ only in where the division by the accumulation steps
(2) happens: on the loss before backward, or on each parameter's gradient before torch accumulates it. Division
by a power of two is exact in fp32 and bf16 (no value here is near the subnormal range), and every backward
operation is linear in the incoming gradient with rounding that commutes with a power-of-two scale, so the
gradients, and therefore every loss, are bitwise equal: the bound is 0. fp16 (the loss must be multiplied by
the loss scale, which only ``engine.backward`` does) refuses at the first ``step()``; an optimizer step with no
gradient since the last one refuses at every stage.

**What goes on the wire** for ``prescale_gradients`` x ``gradient_predivide_factor`` is DeepSpeed's payload:
the sum of |x| the reduction collectives receive during backward, against sum |gradient| of the rank's own
micro-batch in plain torch. The divisors are powers of two, so each payload element is exactly the gradient
divided and the float64 sums of the same fp32 values agree to float64 rounding (rtol 1e-12). The average that
reaches the optimizer is the same in every combination: the weights after one SGD step are bitwise equal.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness.launch import Launch
from tests.harness.models import MODELS, build_model
from tests.harness.runs import ds_config

WORLD = 2
MICRO, GAS, STEPS = 2, 2, 4


# --- the ranks' side: ``direct_*``: a script's own ``loss.backward()`` then ``engine.step()``, against
# ``engine.backward(loss)``, and the steps that must refuse; ``payload_*``: what the data-parallel collectives
# receive during backward, and ``engine.allreduce_bucket``'s payload ------------------------------------------------
def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return MODELS["small_mlp"].batch(torch.Generator().manual_seed(1000 * rank + step), MICRO)


def config(stage: int, gas: int = GAS, optimizer: str = "Adam", lr: float = 1e-2, **extra: Any) -> dict[str, Any]:
    """Adam (no weight decay), buckets of 50, nothing persistent, DeepSpeed's default clipping."""
    return ds_config(stage, MICRO, gas, bucket=50, optimizer={"type": optimizer, "params": {"lr": lr}},
                     zero={"allgather_bucket_size": 50, "stage3_param_persistence_threshold": 0,
                           **extra.pop("zero", {})}, steps_per_print=10**6, gradient_clipping=None, **extra)


def build(cfg: dict[str, Any]) -> Any:
    import dsrun

    net = build_model("small_mlp")
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
    net = build_model("small_mlp")
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


LAUNCHES = {WORLD: Launch(gradient_path, WORLD, timeout=600)}


@pytest.fixture(scope="module")
def ranks(runs) -> list[dict]:
    return runs[WORLD]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_loss_backward_trains_as_engine_backward(ranks, stage, precision):
    for rank in ranks:
        engine = rank[("direct", stage, precision, "engine")]
        direct = rank[("direct", stage, precision, "torch")]
        assert direct["steps"] == STEPS
        assert direct["moved"] > 1e-3  # the weights moved (Adam, lr 1e-2, 4 steps)
        assert direct["losses"][-GAS] < direct["losses"][0] - 0.05  # the same micro-batch, 3 steps later
        assert direct["losses"] == engine["losses"], f"stage {stage} {precision}: loss.backward() differs"


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_loss_backward_refused_at_first_step(ranks, stage):
    for rank in ranks:
        got = rank[("fp16", stage)]
        assert got["message"] is not None and "engine.backward(loss)" in got["message"], got["message"]
        assert got["message"].startswith("engine.step():") and "\n" not in got["message"]
        assert got["unchanged"] and got["micro"] == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_without_gradient_refused(ranks, stage):
    for rank in ranks:
        got = rank[("no_grad", stage)]
        assert got["message"] is not None and "no gradient was produced" in got["message"], got["message"]
        assert got["unchanged"] and got["steps"] == 1


def expected_divisor(stage: int, scatter: bool, prescale: bool, factor: float) -> float:
    """DeepSpeed: prescale divides by the world size; otherwise an all-reduce (engine.allreduce_bucket, ZeRO-1/2
    without reduce-scatter) by the factor, a reduce-scatter (ZeRO-1/2 average_tensor, ZeRO-3) by world x factor."""
    if prescale:
        return WORLD
    return factor * WORLD if (stage == 3 or (stage in (1, 2) and scatter)) else factor


@pytest.mark.parametrize("stage,scatter", PAYLOAD_STAGES)
def test_reduction_payload_follows_deepspeed(ranks, stage, scatter):
    for rank in ranks:
        runs = {combo: rank[("payload", stage, scatter) + combo] for combo in COMBOS}
        for (prescale, factor), got in runs.items():
            divisor = expected_divisor(stage, scatter, prescale, factor)
            assert got["collectives"] > 0
            np.testing.assert_allclose(got["payload"], rank["local"] / divisor, rtol=1e-12,
                                       err_msg=f"prescale={prescale} factor={factor}")
        first = runs[COMBOS[0]]["weights"]
        for combo, got in runs.items():
            np.testing.assert_array_equal(got["weights"], first, err_msg=f"{combo}: the average changed")


def test_allreduce_bucket_payload_follows_deepspeed(ranks):
    for r, rank in enumerate(ranks):
        for prescale, factor in COMBOS:
            sent, mean = rank[("payload", 0, True, prescale, factor)]["bucket"]
            assert sent == pytest.approx(3 * (r + 1) / expected_divisor(0, False, prescale, factor), rel=1e-12)
            assert mean == [1.5, 1.5, 1.5]  # (1 + 2) / 2
