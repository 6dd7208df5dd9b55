"""ZeRO-3 leaf modules: DeepSpeed's flagging API (``set_z3_leaf_modules`` & co.) and the parameter coordinator
treating a leaf as one module (its subtree gathered at its pre-hook, released after it, no hooks below it).
Training a leaf MoE block across ranks: tests/integration/test_zero3_leaf_modules.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dsrun.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                         set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from dsrun.utils.leaf_modules import set_z3_leaf_modules_by_threshold
from dsrun.zero.hooks import ParameterCoordinator
from dsrun.zero.module_gathers import gathered_together
from dsrun.zero.partition_params import ParamStatus, partition_param


class Experts(nn.Module):
    """Runs only the experts named in ``route`` (a list of expert indices), as a router's choice would."""

    def __init__(self, width: int = 4, count: int = 3):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count))
        self.seen: list[list[ParamStatus]] = []  # each forward: the status of every expert parameter

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        self.seen.append([getattr(p, "ds_status", None) for p in self.experts.parameters()])
        return x + sum(self.experts[i](x) for i in route)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.moe = Experts()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        return self.out(self.moe(self.inp(x), route))


def test_flags_by_class_name_and_suffix_as_deepspeed_sets_them() -> None:
    model = nn.Sequential(Block(), Block())
    flagged = set_z3_leaf_modules(model, [Experts])
    assert flagged == [model[0].moe, model[1].moe] and get_z3_leaf_modules(model) == flagged
    assert z3_leaf_module(model[0].moe) and not z3_leaf_module(model[0])
    assert unset_z3_leaf_modules(model, ["Experts"]) == flagged and get_z3_leaf_modules(model) == []
    qualified = f"{Experts.__module__}.{Experts.__qualname__}"
    assert set_z3_leaf_modules(model, [qualified]) == flagged
    unset_z3_leaf_modules(model, [Experts])
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, [nn.LSTM])
    assert set_z3_leaf_modules(model, [nn.LSTM], raise_if_not_found=False) == []
    with pytest.raises(AssertionError, match="types or names"):
        set_z3_leaf_modules(model, [3])
    assert set_z3_leaf_modules_by_name(model, ["0.moe", "9.moe"], raise_if_not_found=False) == ([model[0].moe],
                                                                                              ["9.moe"])
    with pytest.raises(ValueError, match="No modules named"):
        set_z3_leaf_modules_by_name(model, ["9.moe"])
    modules, missing = set_z3_leaf_modules_by_suffix(model, ["moe", "nothing"], raise_if_not_found=False)
    assert modules == flagged and missing == ["nothing"]
    assert set_z3_leaf_modules_by_suffix(model, [".moe"], flag=False)[0] == flagged
    assert get_z3_leaf_modules(model) == []


def _partitioned_block() -> tuple[Block, Block]:
    torch.manual_seed(0)
    model, reference = Block(), Block()
    reference.load_state_dict(model.state_dict())
    set_z3_leaf_modules(model, [Experts])
    for p in model.parameters():
        partition_param(p)
    return model, reference


def test_the_leaf_is_hooked_alone_and_gathers_its_whole_subtree() -> None:
    model, reference = _partitioned_block()
    coordinator = ParameterCoordinator(model, prefetch_bucket_size=0, max_reuse_distance=0)
    leaf = model.moe
    inside = [m for m in leaf.modules() if m is not leaf]
    assert leaf._forward_pre_hooks and leaf._forward_hooks
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in inside)  # no hooks below the leaf
    assert model.inp._forward_pre_hooks and model.out._forward_pre_hooks
    assert {id(p) for p in coordinator._params_of[id(leaf)]} == {id(p) for p in leaf.parameters()}
    assert all(z3_leaf_parameter(p) and p.ds_z3_leaf_module is leaf for p in leaf.parameters())
    assert not any(z3_leaf_parameter(p) for p in model.inp.parameters())
    names = dict(gathered_together(model))  # what NVMe parameter offload must hold at once
    assert "moe.experts.0.0" not in names and len(names["moe"]) == 6

    x = torch.randn(2, 4)
    for route in ([0], [2, 1]):  # expert 2 never runs in the first pass, expert 0 not in the second
        coordinator.begin_forward()
        out = model(x, route)
        # every expert was whole inside the leaf's forward, the skipped ones too; all released after it
        assert all(status is ParamStatus.AVAILABLE for status in leaf.seen[-1])
        assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in leaf.parameters())
        out.sum().backward()
        coordinator.end_backward()
        expected = reference(x, route)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if q.grad is None:  # an expert this pass skipped
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
            p.grad, q.grad = None, None

    coordinator.remove_hooks()
    assert not any(z3_leaf_parameter(p) for p in model.parameters()) and not leaf._forward_pre_hooks


def _stage3_engine(zero: dict) -> tuple[object, Block]:
    import dsrun

    torch.manual_seed(0)
    model = Block()
    # parameters offloaded, so a world of one still partitions and hooks them (without, it keeps them whole and
    # hooks nothing: dsrun/zero/whole_params.py)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, **zero}}
    return dsrun.initialize(model=model, config=config)[0], model


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("leaf_module", [{}, {"classes": ["Experts"]}, {"classes": [f"{__name__}.Experts"]},
                                         {"names": ["moe", "absent"]}, {"name_suffixes": ["moe"]}])
def test_the_config_leaf_module_section_flags_leaves_at_stage_3(leaf_module: dict) -> None:
    """zero_optimization.leaf_module (classes, names, name_suffixes) does what set_z3_leaf_modules does, before
    ZeRO-3 hooks the model; an unmatched name is only a warning, as in DeepSpeed."""
    engine, model = _stage3_engine({"leaf_module": leaf_module})
    is_leaf = bool(leaf_module)
    assert z3_leaf_module(model.moe) is is_leaf and get_z3_leaf_modules(model) == ([model.moe] if is_leaf else [])
    assert all(z3_leaf_parameter(p) is is_leaf for p in model.moe.parameters())
    inner = model.moe.experts[0][0]
    assert bool(inner._forward_pre_hooks) is not is_leaf  # inside a leaf nothing is hooked
    loss = engine(torch.randn(2, 4), [1]).sum()  # experts 0 and 2 skipped: a leaf gathers them all the same
    engine.backward(loss)
    engine.step()
    assert all(status is ParamStatus.AVAILABLE for status in model.moe.seen[-1]) is is_leaf


def test_granularity_threshold_flags_the_outermost_small_modules() -> None:
    """Parameter elements per layer (itself counted): Experts 60 / 4 = 15; containers and torch layers are never
    leaves; a parent small enough is flagged instead of its children."""
    model = nn.Sequential(nn.Linear(4, 32), Experts(), Block())  # Block: 85 elements / 7 layers = 12
    assert set_z3_leaf_modules_by_threshold(model, 11) == [] and get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules_by_threshold(model, 12) == [model[2]]
    assert set_z3_leaf_modules_by_threshold(model, 15) == [model[1], model[2]]
    assert get_z3_leaf_modules(model) == [model[1], model[2]]  # not the Block's own Experts: its parent is one


@pytest.mark.usefixtures("world_of_one")
def test_stage3_module_granularity_threshold_makes_leaves_through_the_config() -> None:
    engine, model = _stage3_engine({"stage3_module_granularity_threshold": 12})
    assert get_z3_leaf_modules(model) == [model]  # the whole Block: 12 elements per layer
    assert _stage3_engine({"stage3_module_granularity_threshold": 0})[1].moe.experts[0][0]._forward_pre_hooks
    assert get_z3_leaf_modules(_stage3_engine({"stage3_module_granularity_threshold": 11})[1]) == []


@pytest.mark.usefixtures("world_of_one")
def test_log_trace_cache_warnings_says_when_a_pass_leaves_the_recorded_order() -> None:
    """zero_optimization.log_trace_cache_warnings: the stage-3 prefetch trace recorded on the first pass stops
    matching when the router picks another expert; with the key that is logged (DeepSpeed's line)."""
    import logging

    from dsrun.utils.logging import logger

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    said = []
    for flag in (False, True):
        engine, _ = _stage3_engine({"log_trace_cache_warnings": flag})
        lines = Lines()
        logger.addHandler(lines)
        try:
            for route in ([0], [0], [2]):  # recorded, followed, left at the expert
                engine.backward(engine(torch.randn(2, 4), route).sum())
                engine.step()
        finally:
            logger.removeHandler(lines)
        said.append([line for line in lines.lines if "Invalidate trace cache" in line])
    assert said[0] == [] and len(said[1]) == 1 and "but got" in said[1][0]
