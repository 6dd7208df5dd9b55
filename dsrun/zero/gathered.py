"""Reading and changing ZeRO-3 parameters outside their module's forward.

``GatheredParameters`` gathers partitioned parameters for the length of a ``with`` block; with
``modifier_rank`` that rank's values are broadcast on exit and every rank keeps its shard of them.
``register_external_parameter`` makes a module gather a parameter it uses but does not own. :func:`full_state_dict`
is the model's state dict with every partitioned parameter gathered.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import torch

from dsrun import comm
from dsrun.zero.eager_fallback import CONTEXT_DEPTH_ATTR, OWNER_ATTR, gather_param, partition_param
from dsrun.zero.hooks import LIVE_COORDINATORS
from dsrun.zero.module_gathers import EXTERNAL_ATTR, add_external_param
from dsrun.zero.partition_params import (ParamStatus, full_tensor, gather_exact, is_zero_param, release_param,
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
    getattr(module, EXTERNAL_ATTR, {}).pop(id(parameter), None)


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
        self._versions: list[tuple[int, int]] | None = None
        self._fallback_owners: dict[int, object] = {}
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self) -> "GatheredParameters":
        if not self.params:
            return self
        held = [p.ds_id for p in self.params if getattr(p, CONTEXT_DEPTH_ATTR, 0)]
        if held:  # refused before gathering anything: the outer block decides when they are released
            raise RuntimeError(f"Nested GatheredParameters contexts cannot overlap parameters; parameter ds_ids "
                               f"already gathered by an outer context: {held}; gather them in one block")
        if "all_gather" in self.params[0].__dict__:  # DeepSpeed's per-parameter method, where one is set
            self._was_available = [p.ds_status is ParamStatus.AVAILABLE for p in self.params]
            gather_param(self.params[0], self.params)
        else:
            self._was_available = gather_exact(self.params)  # exact values, also under qwZ (docs/zeropp.md)
        for p in self.params:
            setattr(p, CONTEXT_DEPTH_ATTR, getattr(p, CONTEXT_DEPTH_ATTR, 0) + 1)
            owner = getattr(p, OWNER_ATTR, None)  # gathered by DeepCompile's eager fallback: adopted here
            if owner is not None:
                self._fallback_owners[p.ds_id] = owner
                owner.record_user_context_claim(p)
        # zero_optimization.enable_sanity_checks (set on the parameters by the stage-3 strategy): without a
        # modifier_rank a change made inside would be lost on exit; DeepSpeed's check catches it
        checked = self.modifier_rank is None and any(getattr(p, "ds_enable_sanity_checks", False) for p in self.params)
        self._versions = [(p.data.data_ptr(), p._version) for p in self.params] if checked else None
        return self

    def _refuse_lost_changes(self) -> None:
        changed = any(p.data.data_ptr() != ptr or p._version != version
                      for p, (ptr, version) in zip(self.params, self._versions or []))
        flag = torch.tensor([float(changed)], device=self.params[0].data.device)
        group = self.params[0].ds_process_group
        if comm.is_initialized() and comm.get_world_size(group) > 1:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group)  # every rank raises, none waits
        if flag.item() > 0:
            for p, was in zip(self.params, self._was_available):
                if not was:
                    release_param(p)
            raise RuntimeError("ZeRO-3 parameters were changed in place inside GatheredParameters with "
                               "modifier_rank=None: the change is lost on exit (zero_optimization."
                               "enable_sanity_checks); pass modifier_rank=<rank> to keep that rank's values")

    def __exit__(self, *exc: object) -> None:
        if not self.params:
            return
        try:
            self._exit(exc)
        finally:
            for p in self.params:
                depth = getattr(p, CONTEXT_DEPTH_ATTR, 0)
                if depth > 1:
                    setattr(p, CONTEXT_DEPTH_ATTR, depth - 1)
                elif hasattr(p, CONTEXT_DEPTH_ATTR):
                    delattr(p, CONTEXT_DEPTH_ATTR)
            for p in self.params:
                owner = self._fallback_owners.get(p.ds_id)
                if owner is not None:
                    owner.release_user_context_claim(p)

    def _to_release(self) -> list[torch.nn.Parameter]:
        """What the exit releases: what it gathered and what DeepCompile's eager fallback had gathered (the
        fallback's copy is transient), except what a compiled forward still needs for its backward."""
        out = []
        for p, was in zip(self.params, self._was_available):
            owner = self._fallback_owners.get(p.ds_id)
            if owner is not None and owner.has_outstanding_graph_claim(p):
                if self.modifier_rank is not None:
                    owner.record_deferred_user_update(p)  # written back when the forward releases it
                continue
            if not was or owner is not None:
                out.append(p)
        return out

    def _exit(self, exc: tuple[object, ...]) -> None:
        if self._versions is not None and exc[0] is None:
            self._refuse_lost_changes()
        if self.modifier_rank is not None:
            keep_modified(self.params, self.modifier_rank)
        release = self._to_release()
        if release and "partition" in release[0].__dict__:
            partition_param(release[0], release, has_been_updated=self.modifier_rank is not None)
        else:
            for p in release:
                release_param(p)


def keep_modified(params: list[torch.nn.Parameter], modifier_rank: int) -> None:
    """Gathered ``params`` changed on ``modifier_rank``: broadcast its values and write them to every rank's shard
    (a parameter with DeepSpeed's own ``partition`` method writes them when partitioned)."""
    with torch.no_grad():
        for p in params:
            group = p.ds_process_group
            src = modifier_rank if group is None else comm.get_global_rank(group, modifier_rank)
            if p.ds_world_size > 1:
                comm.broadcast(p.data, src=src, group=group)
            if "partition" not in p.__dict__:
                write_full_value(p, p.data)


def zero_params(params: Iterable[torch.Tensor]) -> list[torch.nn.Parameter]:
    return _as_param_list(list(params))


def full_state_dict(module: torch.nn.Module, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every partitioned parameter gathered to its full value (on CPU, in the
    model's dtype). Collective: every rank must call it; every rank gets the result."""
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = OrderedDict()
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter) and exclude_frozen_parameters and not value.requires_grad:
            continue
        if is_zero_param(value):
            if id(value) not in gathered:
                gathered[id(value)] = full_tensor(value).cpu()
            out[name] = gathered[id(value)]
        else:
            out[name] = value.detach().cpu().clone()
    return out
