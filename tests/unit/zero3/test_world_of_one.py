"""ZeRO-3 on partition groups of one keeps parameters whole (dsrun/zero/whole_params.py): no gather or release
runs, no module is hooked, every parameter's ``.data`` is its shard, and training equals stage 0's.

Bit for bit, not within a bound: with nothing to gather, stage 3 at a world of one does stage 0's arithmetic in
the same order (the same forward on the same values, each gradient added once to a zeroed fp32 accumulator, no
averaging at one rank, AdamW elementwise on the same values), so any difference would be a bug. MiCS shard groups
of one at two ranks (each parameter whole, gradients all-reduced over the replicas) equal stage 0 at two ranks
bit for bit too: halving is exact in binary floating point, so (a/2 + b/2) is (a + b)/2, and a sum of two
numbers does not depend on the order. Clipping is off: its coefficient comes from a float64 norm that stage 0
sums over its flat buffer and stage 3 over its sub-groups, an order that may move it by an ulp whether or not
parameters are kept whole (at MiCS groups of one with clipping on, the gathering path and this one give the same
bits, both an ulp from stage 0's).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import dsrun
from dsrun.checkpoint import load_file
from dsrun.zero import coalesced_gather, hooks, partition_params
from dsrun.zero.partition_params import ParamStatus
from tests.helpers import run_ranks

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _config(stage: int, **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "gradient_clipping": 0.0, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def _train(engine, steps: int, rank: int = 0) -> list[float]:
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        dtype = next(engine.module.parameters()).dtype
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with dsrun.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


class _Counts:
    """Calls of the coordinator's gather and release functions while a test trains."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls = {"gather": 0, "release": 0}
        for module, name, kind in ((partition_params, "start_gather", "gather"), (hooks, "start_gathers", "gather"),
                                   (coalesced_gather, "start_gather", "gather"), (hooks, "release_param", "release")):
            monkeypatch.setattr(module, name, self._counting(getattr(module, name), kind))

    def _counting(self, fn, kind: str):
        def counted(*args, **kwargs):
            self.calls[kind] += 1
            return fn(*args, **kwargs)
        return counted


def _hooks_on(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + (type(m._parameters) is not dict)
               for m in module.modules())


@pytest.mark.usefixtures("world_of_one")
def test_world_of_one_keeps_parameters_whole_and_trains_like_stage_0(monkeypatch) -> None:
    reference, *_ = dsrun.initialize(model=_model(), config=_config(0))
    expected_losses, expected = _train(reference, STEPS), _weights(reference)
    reference.destroy()

    counts = _Counts(monkeypatch)
    engine, *_ = dsrun.initialize(model=_model(), config=_config(3))
    assert engine.strategy.keeps_whole and _hooks_on(engine.module) == 0
    losses = _train(engine, STEPS)
    assert counts.calls == {"gather": 0, "release": 0}
    for p in engine.module.parameters():  # whole, in its shard's storage, with DeepSpeed's attributes current
        assert p.ds_status is ParamStatus.AVAILABLE and p.ds_world_size == 1 and p.shape == p.ds_shape
        assert p.data_ptr() == p.ds_tensor.data_ptr() and p.numel() == p.ds_numel == p.ds_tensor.numel()
    assert losses == expected_losses
    for got, want in zip(_weights(engine), expected):
        assert torch.equal(got, want)

    # GatheredParameters gathers nothing; with modifier_rank its values reach the fp32 master
    weight = engine.module[0].weight
    with dsrun.zero.GatheredParameters(weight, modifier_rank=0):
        assert weight.data_ptr() == weight.ds_tensor.data_ptr()
        weight.data.fill_(0.5)
    assert torch.equal(dsrun.utils.safe_get_full_fp32_param(weight), torch.full((16, 8), 0.5))
    assert counts.calls == {"gather": 0, "release": 0}
    engine.destroy()

    # the control: parameter offload keeps the coordinator, whose gathers and releases are counted
    offloaded, *_ = dsrun.initialize(model=_model(), config=_config(3, offload_param={"device": "cpu"}))
    assert not offloaded.strategy.keeps_whole and _hooks_on(offloaded.module) > 0
    _train(offloaded, 1)
    assert counts.calls["gather"] > 0 and counts.calls["release"] > 0
    offloaded.destroy()


@pytest.mark.usefixtures("world_of_one")
def test_bf16_world_of_one_writes_the_master_back_through_the_whole_parameter() -> None:
    engine, *_ = dsrun.initialize(model=_model(), config={**_config(3), "bf16": {"enabled": True}})
    assert engine.strategy.keeps_whole
    _train(engine, 1)
    for p in engine.module.parameters():  # the 16-bit shard is what .data views; the step wrote it
        master = dsrun.utils.safe_get_full_fp32_param(p)
        assert p.dtype == torch.bfloat16 and p.data_ptr() == p.ds_tensor.data_ptr()
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
    engine.destroy()


def _at_two_ranks(rank: int, world: int, folder: str) -> dict:
    """One launch for both two-rank checks: resume the world-1 checkpoint, then stage 0 against MiCS of one."""
    engine, *_ = dsrun.initialize(model=_model(), config=_config(3))
    assert not engine.strategy.keeps_whole  # two ranks: partitioned, gathered by the coordinator
    engine.load_checkpoint(folder, tag="one")
    out = {"resumed": _weights(engine)}
    _train(engine, 1, rank)  # and it trains on
    engine.destroy()
    for name, config in (("stage0", _config(0)), ("mics1", _config(3, mics_shard_size=1))):
        engine, *_ = dsrun.initialize(model=_model(), config=config)
        if name == "mics1":
            assert engine.strategy.keeps_whole and _hooks_on(engine.module) == 0
        out[name] = (_train(engine, STEPS, rank), _weights(engine))
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def world_of_one_checkpoint(world_of_one, tmp_path_factory) -> tuple[Path, list[torch.Tensor], list[dict]]:
    """A ZeRO-3 checkpoint saved by a world of one (its folder and weights) and the two-rank results."""
    folder = tmp_path_factory.mktemp("world_of_one")
    engine, *_ = dsrun.initialize(model=_model(), config=_config(3))
    _train(engine, 2)
    engine.save_checkpoint(str(folder), tag="one")
    saved = _weights(engine)
    engine.destroy()
    return folder, saved, run_ranks(_at_two_ranks, 2, str(folder))


def test_a_world_of_one_checkpoint_keeps_the_zero3_layout_and_resumes_at_two_ranks(world_of_one_checkpoint) -> None:
    folder, saved, ranks = world_of_one_checkpoint
    states = load_file(folder / "one" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert all(v.numel() == 0 for v in states["module"].values())  # placeholders, as a partitioned run saves
    [optim_file] = (folder / "one").glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert load_file(optim_file)["optimizer_state_dict"]["partition_count"] == 1
    for rank_result in ranks:
        for got, want in zip(rank_result["resumed"], saved):
            assert torch.equal(got, want)


def test_mics_shard_groups_of_one_keep_parameters_whole_and_train_like_stage_0(world_of_one_checkpoint) -> None:
    for rank_result in world_of_one_checkpoint[2]:
        (losses0, weights0), (losses1, weights1) = rank_result["stage0"], rank_result["mics1"]
        assert losses1 == losses0
        assert all(torch.equal(a, b) for a, b in zip(weights1, weights0))
