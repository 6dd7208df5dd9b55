"""ZeRO strategies, one class per stage family, looked up by stage number.

The engine calls :func:`build_zero_strategy` once at initialize and never branches on the stage again.
Stage 3 plugs in by adding ``dsrun/runtime/zero/stage3.py`` with a ``Stage3Strategy`` (a
:class:`~dsrun.runtime.zero.base.ZeroStrategy`); :data:`STRATEGY_CLASSES` already names it.
"""
from __future__ import annotations

import importlib

from dsrun.utils.errors import ConfigError, Problem

from .base import MemoryBreakdown, StepOutcome, StrategyContext, ZeroStrategy

# stage -> "module:class", imported on first use so a stage's module is only loaded when it is chosen
STRATEGY_CLASSES: dict[int, str] = {
    0: "dsrun.runtime.zero.stage0:DataParallelStrategy",
    1: "dsrun.runtime.zero.partitioned:Stage1Strategy",
    2: "dsrun.runtime.zero.partitioned:Stage2Strategy",
    3: "dsrun.runtime.zero.stage3:Stage3Strategy",
}


def strategy_class(stage: int) -> type[ZeroStrategy]:
    target = STRATEGY_CLASSES.get(stage)
    if target is None:
        raise ConfigError(Problem("zero_optimization.stage", f"got {stage!r}; allowed: 0, 1, 2, 3"))
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ConfigError(Problem("zero_optimization.stage", f"stage {stage} is not available in this build",
                                  "use stage 0, 1 or 2")) from None
    return getattr(module, class_name)


def build_zero_strategy(stage: int, ctx: StrategyContext) -> ZeroStrategy:
    """The strategy for ``stage``, built from ``ctx`` (module, optimizer, precision, bucket sizes…)."""
    return strategy_class(stage)(ctx)


def check_supported(zero_config) -> None:
    """Refuse settings the strategies do not implement yet, rather than training without them.

    Optimizer offload (``offload_optimizer``) validates as a config and is understood by the estimator, but
    no strategy moves optimizer state off the training device yet. Parameter offload (``offload_param``,
    stage 3) is implemented (:mod:`dsrun.runtime.offload.param_swapper`).
    """
    problems = [Problem(f"zero_optimization.{name}.device",
                        f"offload to {section.device!r} is not implemented by dsrun's engine yet",
                        "remove the offload section (offload=none in a recipe) to train without offload")
                for name in ("offload_optimizer",)
                for section in [getattr(zero_config, name)] if section.device not in (None, "none")]
    if problems:
        raise ConfigError(problems)


__all__ = ["MemoryBreakdown", "STRATEGY_CLASSES", "StepOutcome", "StrategyContext", "ZeroStrategy",
           "build_zero_strategy", "check_supported", "strategy_class"]
