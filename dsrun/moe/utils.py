"""``deepspeed.moe.utils``: telling expert parameters apart and giving them their own optimizer groups.

An expert parameter carries ``allreduce = False`` and ``group_name = "ep_size_E"``: its gradient is averaged
over its expert-data-parallel group only, and ZeRO partitions it over that group. Optimizer param groups must
not mix the two kinds: :func:`split_params_into_different_moe_groups_for_optimizer` moves expert parameters
into groups of their own (``"moe": True``, ``"name": group_name``), as DeepSpeed requires.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(module: torch.nn.Module) -> tuple[bool, int]:
    """(whether ``module`` has expert parameters, the number of MoE layers)."""
    from .layer import moe_layers

    layers = moe_layers(module)
    return bool(layers), len(layers)


def split_params_grads_into_shared_and_expert_params(group: Iterable[torch.Tensor]
                                                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(gradients of shared parameters, gradients of expert parameters), skipping parameters without one."""
    shared, expert = [], []
    for p in group:
        if p.grad is None:
            continue
        (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_shared_and_expert_params(params: Iterable[torch.nn.Parameter]
                                               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups: dict[str, Any] | Sequence[dict[str, Any]],
                                                         max_group_size: int | None = 178956971
                                                         ) -> list[dict[str, Any]]:
    """Return ``param_groups`` (a dict, or a list/tuple of dicts) with every expert parameter moved into a
    group of its own expert group name: each original group keeps its shared parameters, and for each name a
    copy of its options gets ``"moe": True``, ``"name": name`` and the experts' parameters, split into groups
    of at most ``max_group_size`` elements. Groups already marked ``"moe"`` are kept as they are."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, (list, tuple)):
        param_groups = [{"params": list(param_groups)}]
    out: list[dict[str, Any]] = []
    moe_groups: list[dict[str, Any]] = []
    for group in param_groups:
        if group.get("moe"):
            out.append(group)
            continue
        shared, by_name = [], {}
        for p in group["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
            else:
                shared.append(p)
        out.append({**group, "params": shared})
        for name, params in by_name.items():
            chunk: list[torch.nn.Parameter] = []
            size = 0
            for p in params:
                if chunk and max_group_size is not None and size + p.numel() > max_group_size:
                    moe_groups.append({**group, "params": chunk, "moe": True, "name": name})
                    chunk, size = [], 0
                chunk.append(p)
                size += p.numel()
            if chunk:
                moe_groups.append({**group, "params": chunk, "moe": True, "name": name})
    return out + moe_groups
