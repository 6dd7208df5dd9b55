"""Which partitioned parameters ZeRO-3's coordinator (:mod:`.hooks`) gathers around each module's passes.

A module gathers its own parameters and the *external* ones registered on it (``register_external_parameter``,
or a parameter read inside its forward, :class:`~.hooks.GatheringParameters`); a ZeRO-3 leaf module
(:mod:`dsrun.utils.leaf_modules`) or a compile region gathers its whole subtree's at once, its children unhooked.
NVMe parameter offload sizes its buffers by these sets (:func:`gathered_together`).
"""
from __future__ import annotations

from typing import Collection, Iterable

import torch

from dsrun.utils.leaf_modules import z3_leaf_module
from dsrun.zero.partition_params import is_zero_param

EXTERNAL_ATTR = "_ds_external_params"


def external_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(getattr(module, EXTERNAL_ATTR, {}).values())


def add_external_param(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    registry = module.__dict__.setdefault(EXTERNAL_ATTR, {})
    registry[id(param)] = param


def module_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The partitioned parameters ``module`` needs for its own computation: its direct parameters and the
    external ones registered on it (each once)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for p in list(module.parameters(recurse=False)) + external_params(module):
        if is_zero_param(p):
            seen.setdefault(id(p), p)
    return list(seen.values())


def leaf_params(leaf: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The partitioned parameters a leaf module gathers at once: those of its whole subtree and the external
    ones registered on any module in it (each once)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for module in leaf.modules():
        for p in module_params(module):
            seen.setdefault(id(p), p)
    return list(seen.values())


def gathered_whole(module: torch.nn.Module, units: Collection[int] = ()) -> bool:
    """Whether ``module``'s subtree is gathered at once: a leaf, or a compile region (``units``: module ids)."""
    return z3_leaf_module(module) or id(module) in units


def gathered_params(module: torch.nn.Module, units: Collection[int] = ()) -> list[torch.nn.Parameter]:
    """What the coordinator gathers around ``module``'s passes: a leaf's (or compile region's) subtree, another
    module's own."""
    return leaf_params(module) if gathered_whole(module, units) else module_params(module)


def hooked_modules(root: torch.nn.Module, units: Collection[int] = ()) -> list[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` without the modules inside a leaf or a compile region (``units``; the leaf or
    region itself is kept): the modules the coordinator may hook, each with the parameters it gathers being
    :func:`gathered_params`'s."""
    kept: list[tuple[str, torch.nn.Module]] = []
    leaves: list[str] = []
    for name, module in root.named_modules():
        if any(leaf == "" or name.startswith(leaf + ".") for leaf in leaves):
            continue
        if gathered_whole(module, units):
            leaves.append(name)
        kept.append((name, module))
    return kept


def gathered_together(root: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """``(module name, the parameters its hooks gather at once)`` for each module of ``root`` that could be
    hooked (NVMe parameter offload checks each set fits its buffers)."""
    return [(name or "root", gathered_params(module)) for name, module in hooked_modules(root)]


def iter_unique_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    seen: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())
