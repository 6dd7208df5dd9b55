"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` on 2 ranks at ZeRO stages 0-3: the same full tensors at
every stage, equal to plain PyTorch's (float64, one process); a value set through them changes training as
assigning it in plain PyTorch would. The local pieces of the ranks put together are the full value.

Tolerances: the ranks train in fp32 and the reference in float64; every quantity here is a short sum or a few
Adam steps of O(1) values, so they agree to a few hundred fp32 roundings (rtol 1e-5, atol 1e-6 for values of
order 1e-2 to 1). Across stages the arithmetic on 2 ranks is the same sums in the same order, so stages agree
to a few roundings (rtol 1e-6).

A small MLP (``surface_mlp``) trains three AdamW steps on a fixed global batch per step (each rank takes its
slice). After the second backward the full gradients are read; after the second step the fp32 weights and
Adam moments (full and local pieces); then ``safe_set_full_fp32_param`` gives the first layer's weight a new
value and ``safe_set_full_optimizer_state`` zeroes the last layer's ``exp_avg``, and a third step runs, whose
gradients are changed between backward and step: ``safe_set_full_grad`` gives the last bias a new gradient,
``safe_set_local_grad`` halves each rank's piece of the first bias's, ``safe_update_full_grad_vectorized`` doubles
the last weight's (powers of two and a set value: exact in fp32, so each agrees as the unchanged ones do)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.harness.launch import Launch, Runs
from tests.harness.models import as_numpy as _np
from tests.harness.models import build_model
from tests.harness.models import surface_batch as batch
from tests.harness.runs import ds_config

STAGES = [0, 1, 2, 3]
GLOBAL_BATCH, LR = 4, 1e-2


def new_weight(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value safe_set_full_fp32_param gives the first layer's weight."""
    return (torch.arange(60, dtype=torch.float64).reshape(10, 6) / 60 - 0.5).to(dtype)


def new_bias_grad(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The gradient safe_set_full_grad gives the last layer's bias at the third step."""
    return torch.tensor([0.25, -0.5, 0.125], dtype=dtype)


def reference() -> dict[str, Any]:
    """The same three steps in plain PyTorch, one process, float64."""
    model = build_model("surface_mlp").to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out: dict[str, Any] = {}
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                model[0].weight.copy_(new_weight(torch.float64))
            opt.state[model[2].weight]["exp_avg"].zero_()
        x, y = batch(step, torch.float64)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == 1:
            out["grad"] = {n: _np(p.grad) for n, p in model.named_parameters()}
        if step == 2:
            model[2].bias.grad.copy_(new_bias_grad(torch.float64))
            model[0].bias.grad.mul_(0.5)
            model[2].weight.grad.mul_(2.0)
        if step == 2:
            out["loss3"] = loss.item()
        opt.step()
        opt.zero_grad()
        if step == 1:
            out["fp32"] = {n: _np(p) for n, p in model.named_parameters()}
            out["exp_avg"] = {n: _np(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
            out["exp_avg_sq"] = {n: _np(opt.state[p]["exp_avg_sq"]) for n, p in model.named_parameters()}
    out["final"] = {n: _np(p) for n, p in model.named_parameters()}
    return out


def safe_api_stages(rank: int, world: int, stages: list[int]) -> dict[int, dict[str, Any]]:
    from dsrun import comm

    try:
        return {stage: _one_stage(rank, world, stage) for stage in stages}
    finally:
        if comm.is_initialized():
            comm.destroy_process_group()


def _one_stage(rank: int, world: int, stage: int) -> dict[str, Any]:
    import dsrun
    from dsrun import comm
    from dsrun.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                             safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                             safe_set_local_grad, safe_update_full_grad_vectorized)

    model = build_model("surface_mlp")
    zero: dict[str, Any] = {"allgather_bucket_size": 50}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    # unclipped (ds_config's default), like the plain PyTorch AdamW of the reference
    cfg = ds_config(stage, GLOBAL_BATCH // world, 1, bucket=50, zero=zero,
                    optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}})
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    names = [n for n, _ in engine.module.named_parameters()]
    params = dict(engine.module.named_parameters())
    per = GLOBAL_BATCH // world
    out: dict[str, Any] = {}
    for step in range(3):
        if step == 2:
            safe_set_full_fp32_param(params["0.weight"], new_weight())
            safe_set_full_optimizer_state(params["2.weight"], torch.zeros(3, 10), "exp_avg")
            out["after_set"] = _np(safe_get_full_fp32_param(params["0.weight"]))
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        if step == 1:
            out["grad"] = {n: _np(safe_get_full_grad(params[n])) for n in names}
        if step == 2:
            safe_set_full_grad(params["2.bias"], new_bias_grad())
            out["grad_after_set"] = _np(safe_get_full_grad(params["2.bias"]))
            safe_set_local_grad(params["0.bias"], safe_get_local_grad(params["0.bias"]) * 0.5)
            safe_update_full_grad_vectorized([params["2.weight"]], lambda grad, param: grad * 2.0)
            mean = loss.detach().double().reshape(1)
            comm.all_reduce(mean)
            out["loss3"] = mean.item() / world
        engine.step()
        if step == 1:
            out["fp32"] = {n: _np(safe_get_full_fp32_param(params[n])) for n in names}
            out["exp_avg"] = {n: _np(safe_get_full_optimizer_state(params[n], "exp_avg")) for n in names}
            out["exp_avg_sq"] = {n: _np(safe_get_full_optimizer_state(params[n], "exp_avg_sq")) for n in names}
            out["local_fp32"] = {n: _np(safe_get_local_fp32_param(params[n])) for n in names}
            out["local_exp_avg"] = {n: _np(safe_get_local_optimizer_state(params[n], "exp_avg")) for n in names}
    out["final"] = {n: _np(safe_get_full_fp32_param(params[n])) for n in names}
    comm.barrier()
    return out




LAUNCHES = {"stages": Launch(safe_api_stages, 2, (STAGES,), timeout=400)}


def collect(runs: Runs):
    return runs["stages"], reference()


@pytest.mark.parametrize("stage", STAGES)
def test_full_values_equal_plain_pytorch_at_every_stage(runs, stage):
    ranks, ref = runs
    for rank in ranks:  # every rank gets the full value
        got = rank[stage]
        for what in ("grad", "fp32", "exp_avg", "exp_avg_sq", "final"):
            for name, value in ref[what].items():
                np.testing.assert_allclose(got[what][name], value, rtol=1e-5, atol=1e-6, err_msg=f"{what} {name}")
                np.testing.assert_allclose(got[what][name], ranks[0][0][what][name], rtol=1e-6, atol=1e-8,
                                           err_msg=f"stage {stage} vs stage 0: {what} {name}")


@pytest.mark.parametrize("stage", STAGES)
def test_set_full_values_change_training_like_plain_pytorch(runs, stage):
    ranks, ref = runs
    for rank in ranks:
        np.testing.assert_array_equal(rank[stage]["after_set"], new_weight().double().numpy())
        np.testing.assert_array_equal(rank[stage]["grad_after_set"], new_bias_grad().double().numpy())
        # the third step's forward used the new weight (the loss) and its update the zeroed moment and the
        # changed gradients (the weights)
        assert rank[stage]["loss3"] == pytest.approx(ref["loss3"], rel=1e-5)
        for name, value in ref["final"].items():
            np.testing.assert_allclose(rank[stage]["final"][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("stage", STAGES)
def test_local_pieces_make_up_the_full_value(runs, stage):
    ranks, _ = runs
    for what, full in (("local_fp32", "fp32"), ("local_exp_avg", "exp_avg")):
        for name, value in ranks[0][stage][full].items():
            pieces = [rank[stage][what][name] for rank in ranks]
            if stage == 0:  # nothing is partitioned: each rank holds the whole value
                for piece in pieces:
                    np.testing.assert_array_equal(piece, value.reshape(-1))
                continue
            if stage == 3:  # equal shards, the last one padded with zeros
                assert len({p.size for p in pieces}) == 1
            joined = np.concatenate(pieces)
            np.testing.assert_array_equal(joined[:value.size], value.reshape(-1))
            assert not joined[value.size:].any()
