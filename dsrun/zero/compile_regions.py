"""``torch.compile`` under ZeRO: which parts of the model are compiled, and how the stage-3 hooks stay outside.

At stages 0-2 (and at stage 3 where parameters are kept whole: :mod:`.whole_params`) nothing runs inside a
module's forward but the model's own code: the whole module is compiled (``module.compile(...)``, one graph, no
break caused by dsrun). The stages' gradient hooks run in backward, outside dynamo's reach.

At stage 3 the parameter coordinator (:mod:`.hooks`) gathers and releases parameters in forward hooks:
Python bookkeeping and collectives that dynamo cannot trace, and whose state (trace cursors, gathered
statuses) would make it guard and recompile on every module (the recompile limit hit in ``_post_forward``).
So, as torchtitan does with FSDP2, the compile regions are the model's repeated blocks
(:func:`compile_units`: each parameter-holding element of an ``nn.ModuleList``), each compiled on its own; the
coordinator gathers each block whole (its pre-forward hook gathers every parameter of the block, its children
are not hooked) and its hooks are ``torch.compiler.disable``d, so they run eagerly around the compiled
forward: no graph break inside a block, none between blocks (the code between them runs eagerly). A model
without such blocks (or with NVMe parameter offload, whose buffers are sized for single modules, or whose
blocks hold ZeRO-3 leaf modules) is compiled whole with the opaque hooks: at most one break per hooked module.
"""
from __future__ import annotations

from typing import Any

import torch

from dsrun.utils.leaf_modules import z3_leaf_module
from dsrun.zero.hooks import ParameterCoordinator
from dsrun.zero.partition_params import is_zero_param


def compile_units(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost elements of ``root``'s ``nn.ModuleList``s that hold partitioned parameters and neither are
    nor hold nor sit inside a ZeRO-3 leaf module (a transformer's blocks), in module order."""
    units: list[torch.nn.Module] = []
    taken: set[int] = set()  # units and everything inside them
    inside_leaf: set[int] = set()
    for module in root.modules():
        if z3_leaf_module(module):
            inside_leaf.update(id(m) for m in module.modules())
    for module in root.modules():
        if not isinstance(module, torch.nn.ModuleList) or id(module) in taken or id(module) in inside_leaf:
            continue
        for block in module:
            subtree = list(block.modules())
            if any(id(m) in inside_leaf for m in subtree) or not any(is_zero_param(p) for p in block.parameters()):
                continue
            units.append(block)
            taken.update(id(m) for m in subtree)
    return units


def compile_model(module: torch.nn.Module, strategy: object | None, backend: str,
                  kwargs: dict[str, Any]) -> list[torch.nn.Module]:
    """``torch.compile`` ``module`` trained by ``strategy`` (the engine's ZeRO strategy, None without an
    optimizer); returns the modules compiled (``[module]`` when it is compiled whole)."""
    coordinator = getattr(strategy, "coordinator", None)
    if not isinstance(coordinator, ParameterCoordinator):  # stages 0-2, or ZeRO-3 kept whole: no forward hooks
        module.compile(backend=backend, **kwargs)
        return [module]
    nvme_params = getattr(getattr(strategy, "param_offload", None), "device", None) == "nvme"
    units = [] if nvme_params else compile_units(module)
    coordinator.compile_regions(units)
    if not units:
        module.compile(backend=backend, **kwargs)
        return [module]
    for unit in units:
        unit.compile(backend=backend, **kwargs)
    return units
