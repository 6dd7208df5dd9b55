"""Turning layers into random-LTD layers and back: DeepSpeed's ``data_routing.helper``.

``convert_to_random_ltd(engine, LayerClass)`` wraps every ``LayerClass`` module of the engine's model in
:class:`RandomLayerTokenDrop` and lets the engine attach the schedule to the layers the config names
(``random_ltd_layer_id``). Checkpoints written by the engine hold the original parameter names
(:func:`remove_random_ltd_state_dict`), so they load into the unconverted model.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, TypeVar

from torch import nn

from dsrun.data_efficiency.data_routing.basic_layer import RandomLayerTokenDrop

WRAPPED = ".random_ltd_layer"
M = TypeVar("M", bound=nn.Module)  # a model or the engine that wraps it (``.module``)


def _inner(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def convert_to_random_ltd(model: M, convert_type: type[nn.Module]) -> M:
    """Wrap each ``convert_type`` submodule (not already wrapped) in :class:`RandomLayerTokenDrop`, then call
    ``model.random_ltd_initialize()`` (the engine's) to give the configured layers their schedule; returns
    ``model``."""
    root = _inner(model)
    targets = [name for name, module in root.named_modules()
               if isinstance(module, convert_type) and name and not name.endswith(WRAPPED.lstrip("."))]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, RandomLayerTokenDrop(getattr(parent, child)))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    """``state_dict`` with the wrapper's ``.random_ltd_layer`` removed from every key."""
    return OrderedDict((key.replace(WRAPPED, ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: nn.Module) -> "OrderedDict[str, Any]":
    """The model's state dict under its original (unwrapped) names."""
    return remove_random_ltd_state_dict(_inner(model).state_dict())
