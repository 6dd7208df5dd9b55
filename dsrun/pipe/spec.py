"""``LayerSpec`` and ``TiedLayerSpec``: a layer described, built only on the stage that owns it.

A :class:`~dsrun.pipe.module.PipelineModule` given specs instead of modules builds each layer on its
own stage only, so a machine with 16 ranks holds the model once, not 16 times. A ``TiedLayerSpec`` names a
``key``: every spec with the same key is one module (an embedding used again as the output head), built
once per stage that holds any of them; the engine keeps its weights identical across those stages.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import torch
from torch import nn


class LayerSpec:
    """``LayerSpec(torch.nn.Linear, 16, 32, bias=False)`` builds ``torch.nn.Linear(16, 32, bias=False)``
    when :meth:`build` is called."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """Construct the module."""
        if log:
            print(f"[dsrun] building {self!r}", flush=True)
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer shared by ``key`` with every other ``TiedLayerSpec`` of the same key. ``forward_fn(module,
    inputs)``, if given, replaces ``module(inputs)`` at this position (an embedding table used as a head);
    ``tied_weight_attr`` names the parameters whose gradients are summed over the stages sharing the key."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = ["weight"], **module_kwargs: Any):  # noqa: B006 (DeepSpeed's default)
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


# one entry of a PipelineModule's layers: a module, a spec built on the stage that holds it, or a function
PipeLayer = Union[nn.Module, LayerSpec, Callable[..., Any]]
# what one layer hands the next: a tensor, or a tuple of them (and other values)
Activations = Union[torch.Tensor, tuple[Any, ...]]
