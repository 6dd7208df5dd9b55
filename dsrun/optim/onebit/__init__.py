"""The 1-bit optimizers at DeepSpeed's module paths: ``onebit.adam.OnebitAdam``, ``onebit.zoadam.ZeroOneAdam``,
``onebit.lamb.OnebitLamb``; selected in a config by ``optimizer.type`` OneBitAdam, ZeroOneAdam, OneBitLamb.
How they work, what they send and what they cost: docs/onebit.md."""
from __future__ import annotations

from typing import Any, Iterable, Protocol

from dsrun.config import DSConfig
from dsrun.features import Feature
from dsrun.utils.errors import ConfigError, Problem, show

from dsrun.optim.onebit.adam import OnebitAdam
from dsrun.optim.onebit.base import BoundStrategy, OneBitOptimizer
from dsrun.optim.onebit.lamb import OnebitLamb
from dsrun.optim.onebit.zoadam import ZeroOneAdam

# optimizer.type, lower-cased -> class
ONE_BIT_CLASSES: dict[str, type[OneBitOptimizer]] = {"onebitadam": OnebitAdam, "zerooneadam": ZeroOneAdam,
                                                     "onebitlamb": OnebitLamb}


def build_onebit_optimizer(type_name: str, params: Iterable[Any], optimizer_params: dict[str, Any] | None = None,
                           deepspeed: Any = None) -> OneBitOptimizer:
    """The 1-bit optimizer ``type_name`` names (case-insensitive), over ``params``; a params key its
    constructor does not take is a ConfigError naming it."""
    cls = ONE_BIT_CLASSES[type_name.lower()]
    kwargs = dict(optimizer_params or {})
    kwargs.pop("deepspeed", None)
    try:
        return cls(params, deepspeed=deepspeed, **kwargs)
    except TypeError as exc:
        raise ConfigError(Problem("optimizer.params", f"{type_name} rejected the params {show(kwargs)}: {exc}",
                                  "params must be keyword arguments of the optimizer's constructor")) from None


class _Engine(Protocol):
    strategy: BoundStrategy | None  # the engine's ZeRO strategy (None: no optimizer)


class OneBitFeature(Feature):
    """Binds a 1-bit optimizer (the config's or the client's) to the engine's ZeRO strategy once the engine is
    built: it learns the master layout and attaches at the strategy's step hooks
    (:meth:`OneBitOptimizer.bind_strategy`). Any other optimizer: nothing to do."""

    name = "onebit"

    @classmethod
    def build(cls, config: DSConfig) -> "OneBitFeature":
        return cls()  # the optimizer may be the client's: attach looks at the one the strategy steps

    def attach(self, engine: _Engine) -> None:  # type: ignore[override]
        strategy = engine.strategy
        if strategy is not None and isinstance(strategy.optimizer, OneBitOptimizer):
            strategy.optimizer.bind_strategy(strategy)


__all__ = ["ONE_BIT_CLASSES", "OneBitFeature", "OneBitOptimizer", "OnebitAdam", "OnebitLamb", "ZeroOneAdam", "build_onebit_optimizer"]
