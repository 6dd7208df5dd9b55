"""``compile.autoep_non_moe`` (DeepSpeed's ``compile_autoep_non_moe_regions``): ``engine.compile()`` compiles the
module holding each AutoEP layer (its parent: a transformer block) and leaves the AutoEP layer itself eager.

The layer's routing, token exchange (variable-size all-to-alls) and expert matmuls change shape with every batch's
routing, so a graph of them would recompile or break; the layer's forward is wrapped in ``torch._dynamo.disable``
(a deliberate graph break), and each parent is compiled with ``fullgraph=False, dynamic=False``, so the attention
and the rest of the block around it are compiled graphs.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from dsrun.autoep.layer import AutoEPMoELayer


def compile_autoep_non_moe_regions(model: nn.Module, backend: str | Callable, compile_kwargs: dict[str, Any]) -> list[str]:
    """Compile the parents of ``model``'s AutoEP layers (each once), the layers themselves left eager; returns the
    compiled modules' names. ``ValueError`` when there is no AutoEP layer, one is the model's root or its parent
    has no forward or is compiled already, or ``compile_kwargs`` asks for ``fullgraph`` or ``dynamic``."""
    modules = dict(model.named_modules())
    layers = [(name, m) for name, m in modules.items() if isinstance(m, AutoEPMoELayer)]
    if not layers:
        raise ValueError("compile.autoep_non_moe=True requires at least one AutoEPMoELayer: enable expert_parallel "
                         "and call compile() after initialize()")
    if compile_kwargs.get("fullgraph", False) is not False:
        raise ValueError("compile.autoep_non_moe=True requires fullgraph=False: the AutoEP layer is a graph break")
    if compile_kwargs.get("dynamic", False) is not False:
        raise ValueError("compile.autoep_non_moe=True requires dynamic=False")
    regions: OrderedDict[str, nn.Module] = OrderedDict()
    for name, _ in layers:
        if not name:
            raise ValueError("compile.autoep_non_moe=True cannot compile an AutoEPMoELayer at the model's root")
        parent_name = name.rpartition(".")[0]
        parent = modules[parent_name]
        if type(parent).forward is nn.Module.forward:
            raise ValueError(f"AutoEP compile region {parent_name!r} has no forward: the MoE layer must be a direct "
                             "child of a module that calls it")
        if getattr(parent, "_compiled_call_impl", None) is not None:
            raise ValueError(f"AutoEP compile region {parent_name!r} is already compiled")
        regions.setdefault(parent_name, parent)
    kwargs = {"fullgraph": False, "dynamic": False, **compile_kwargs, "backend": backend}
    saved_forwards = {layer: layer.__dict__.get("forward") for _, layer in layers}
    try:
        for _, layer in layers:
            layer.forward = torch._dynamo.disable(layer.forward)
        for region in regions.values():
            region.compile(**kwargs)
    except BaseException:
        for layer, forward in saved_forwards.items():
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward
        for region in regions.values():
            region._compiled_call_impl = None
        raise
    return list(regions)
