"""``no_sync()``, ``enable_backward_allreduce = False`` with ``allreduce_gradients()``, and DeepSpeed's
``buffered_allreduce_fallback`` on 2 ranks at ZeRO stages 0 and 1 (stages 2-3 refuse ``no_sync``, as in
DeepSpeed): the gradients a rank kept to itself are reduced once, and the step equals plain PyTorch's
(float64, one process). Tolerance: a few fp32 roundings of O(1) sums (rtol 1e-5, atol 1e-7 for SGD steps
of 0.1 x gradients of order 1)."""
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

STAGES = [0, 1]
GLOBAL_BATCH = 4


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
        # unclipped (ds_config's default), like the plain PyTorch SGD of the reference; DeepSpeed's all-gather
        # bucket
        cfg = ds_config(stage, per, 1, bucket=50, zero={"allgather_bucket_size": 500_000_000},
                        optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero_allow_untested_optimizer=True)
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


LAUNCHES = {"stages": Launch(reduction_stages, 2, (STAGES,), timeout=300)}


def collect(runs: Runs):
    return runs["stages"], reduction_reference()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", ["no_sync", "deferred"])
def test_gradients_kept_back_are_reduced_once(runs, stage, case):
    ranks, ref = runs
    for rank in ranks:
        for name, value in ref[case].items():
            np.testing.assert_allclose(rank[stage][case][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
        assert rank[stage]["applied"]


@pytest.mark.parametrize("stage", STAGES)
def test_buffered_allreduce_fallback_averages(runs, stage):
    ranks, _ = runs
    for rank in ranks:
        small, square = rank[stage]["fallback"]
        np.testing.assert_array_equal(small, np.full(3, 1.5))  # (1 + 2) / 2
        np.testing.assert_array_equal(square, np.full((2, 2), 5.0))  # (0 + 10) / 2
