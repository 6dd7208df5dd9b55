"""Per-rank jobs for tests/integration/test_safe_get.py (importable by ``tests.helpers.run_ranks`` ranks) and the
plain-PyTorch reference they are compared with.

A small MLP trains three AdamW steps on a fixed global batch per step (each rank takes its slice). After the
second backward the full gradients are read; after the second step the fp32 weights and Adam moments (full
and local pieces); then ``safe_set_full_fp32_param`` gives the first layer's weight a new value and
``safe_set_full_optimizer_state`` zeroes the last layer's ``exp_avg``, and a third step runs.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.harness.models import MODELS, build_model

GLOBAL_BATCH, LR = 4, 1e-2


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = MODELS["surface_mlp"].batch(torch.Generator().manual_seed(100 + step), GLOBAL_BATCH)
    return x.to(dtype), y.to(dtype)


def new_weight(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value safe_set_full_fp32_param gives the first layer's weight."""
    return (torch.arange(60, dtype=torch.float64).reshape(10, 6) / 60 - 0.5).to(dtype)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy().copy()  # a copy: a float64 tensor shares its memory


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
                             safe_get_local_fp32_param, safe_get_local_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)

    model = build_model("surface_mlp")
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}, "zero_optimization": zero,
           "steps_per_print": 1000, "gradient_clipping": 0.0}  # the reference is plain PyTorch's unclipped AdamW
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


def reduction_reference() -> dict[str, Any]:
    """Plain PyTorch (float64, one process): one SGD step on the sum of two global batches' losses, and one on
    a single global batch's loss."""
    out = {}
    for name, steps in (("no_sync", (0, 1)), ("deferred", (0,))):
        model = build_model("surface_mlp").to(torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in (batch(s, torch.float64) for s in steps))
        loss.backward()
        opt.step()
        out[name] = {n: _np(p) for n, p in model.named_parameters()}
    return out


def reduction_stages(rank: int, world: int, stages: list[int]) -> dict[int, dict[str, Any]]:
    """At each stage: two backwards, the first inside ``no_sync()``, then one step; one backward with
    ``enable_backward_allreduce = False`` reduced by ``allreduce_gradients()``; and DeepSpeed's
    ``buffered_allreduce_fallback`` on tensors that differ per rank."""
    import dsrun
    from dsrun import comm

    per = GLOBAL_BATCH // world

    def engine_at(stage):
        model = build_model("surface_mlp")
        cfg = {"train_micro_batch_size_per_gpu": per, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 50}, "steps_per_print": 1000,
               "gradient_clipping": 0.0}  # the reference is plain PyTorch's unclipped SGD
        return dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def micro(engine, step):
        x, y = batch(step)
        return torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])

    try:
        out: dict[int, dict[str, Any]] = {}
        for stage in stages:
            engine = engine_at(stage)
            with engine.no_sync():
                engine.backward(micro(engine, 0))
            engine.backward(micro(engine, 1))
            engine.step()
            result = {"no_sync": {n: _np(p) for n, p in engine.module.named_parameters()}}
            engine = engine_at(stage)
            engine.enable_backward_allreduce = False
            engine.backward(micro(engine, 0))
            engine.allreduce_gradients()
            engine.step()
            result["deferred"] = {n: _np(p) for n, p in engine.module.named_parameters()}
            result["applied"] = engine.was_step_applied()
            grads = [torch.full((3,), float(rank + 1)), torch.full((2, 2), float(10 * rank))]
            engine.buffered_allreduce_fallback(grads=grads)
            result["fallback"] = [_np(g) for g in grads]
            out[stage] = result
        comm.barrier()
        return out
    finally:
        if comm.is_initialized():
            comm.destroy_process_group()
