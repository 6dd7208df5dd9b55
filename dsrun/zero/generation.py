"""DeepSpeed's ``runtime.zero.unwrap_model_for_generation``: a ZeRO-3 model whole for a generation loop.

Generating token by token runs the model's forward once per token; under ZeRO-3 each forward would gather and
release every parameter again. Inside ``with unwrap_model_for_generation(engine):`` (TRL's RLHF trainers call it
around ``generate``) every parameter is gathered once and the engine's parameter hooks are off
(:meth:`dsrun.zero.hooks.ParameterCoordinator.unhooked`); on exit the parameters are released and the hooks come
back, the next training pass recording its gather order anew. Other stages' models are whole already: it only
yields the engine.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Protocol, TypeVar

import torch

from dsrun.zero.gathered import GatheredParameters
from dsrun.zero.hooks import ParameterCoordinator

__all__ = ["unwrap_model_for_generation"]


class _Engine(Protocol):
    module: torch.nn.Module
    strategy: object | None


EngineT = TypeVar("EngineT", bound=_Engine)


@contextlib.contextmanager
def unwrap_model_for_generation(model: EngineT) -> Iterator[EngineT]:
    """Gather every parameter of ``model`` (a DeepSpeed engine) and lift its ZeRO-3 hooks for the block;
    yields ``model``. Collective at ZeRO-3: every rank enters it."""
    # the ZeRO-3 strategy's coordinator, or an engine's without an optimizer (ZeRO-Inference)
    coordinator = getattr(model.strategy or getattr(model, "parameter_offload", None), "coordinator", None)
    with GatheredParameters(list(model.module.parameters())):
        if not isinstance(coordinator, ParameterCoordinator):
            yield model
            return
        with coordinator.unhooked():
            yield model
