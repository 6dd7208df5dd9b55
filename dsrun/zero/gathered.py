"""Reading and changing ZeRO-3 parameters outside their module's forward.

``GatheredParameters`` gathers partitioned parameters for the length of a ``with`` block; with
``modifier_rank`` that rank's values are broadcast on exit and every rank keeps its shard of them.
``register_external_parameter`` makes a module gather a parameter it uses but does not own.
"""
from __future__ import annotations

from typing import Iterable

import torch

from dsrun import comm
from dsrun.zero.hooks import LIVE_COORDINATORS, add_external_param
from dsrun.zero.partition_params import (gather_exact, is_zero_param, release_param,
                                                 write_full_value)

def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Gather ``parameter`` for ``module``'s forward and backward, although ``module`` does not own it (for
    example a parent that uses a child's weight directly). Raises RuntimeError for a non-Parameter."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(f"register_external_parameter: expected a torch.nn.Parameter, got "
                           f"{type(parameter).__name__}")
    add_external_param(module, parameter)
    for coordinator in list(LIVE_COORDINATORS):
        if any(m is module for m in coordinator.root.modules()):
            coordinator.hook_module(module)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    getattr(module, "_ds_external_params", {}).pop(id(parameter), None)


def _as_param_list(params: torch.Tensor | Iterable[torch.Tensor] | None) -> list[torch.nn.Parameter]:
    if isinstance(params, torch.Tensor):
        params = [params]
    unique: dict[int, torch.nn.Parameter] = {}
    for p in params if params is not None else []:
        if isinstance(p, torch.nn.Parameter) and is_zero_param(p):  # others are silently ignored
            unique.setdefault(id(p), p)
    # the same order on every rank, whatever order the caller listed them in
    return sorted(unique.values(), key=lambda p: p.ds_id)


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):`` the full
    values of ``params`` (one Parameter or an iterable; non-ZeRO tensors are ignored) inside the block.

    Collective: every rank of the data-parallel group must enter it, in the same order. Changes made inside
    are kept only with ``modifier_rank``: that rank's values (a rank in the parameters' group) are broadcast
    on exit, and every rank re-partitions them (the optimizer's fp32 copy too). ``fwd_module`` also registers
    the parameters as external parameters of that module. ``enabled=False`` makes it a no-op.
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor] | None, modifier_rank: int | None = None,
                 fwd_module: torch.nn.Module | None = None, enabled: bool = True):
        self.enabled = enabled
        self.params = _as_param_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._was_available: list[bool] = []
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self) -> "GatheredParameters":
        self._was_available = gather_exact(self.params)  # exact values, also under qwZ (docs/zeropp.md)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.params:
            return
        if self.modifier_rank is not None:
            with torch.no_grad():
                for p in self.params:
                    group = p.ds_process_group
                    src = self.modifier_rank if group is None else comm.get_global_rank(group, self.modifier_rank)
                    if p.ds_world_size > 1:
                        comm.broadcast(p.data, src=src, group=group)
                    write_full_value(p, p.data)
        for p, was in zip(self.params, self._was_available):
            if not was:
                release_param(p)


def zero_params(params: Iterable[torch.Tensor]) -> list[torch.nn.Parameter]:
    return _as_param_list(list(params))
