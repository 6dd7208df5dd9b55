"""ZeRO strategies, one class per stage family, looked up by stage number.

The engine calls :func:`build_zero_strategy` once at initialize and never branches on the stage again.
"""
from __future__ import annotations

import importlib

import torch

from dsrun.optim import optimizer_wrappers
from dsrun.utils.errors import ConfigError, Problem

from dsrun.zero.base import StepOutcome, StrategyContext, ZeroStrategy
from dsrun.zero.memory import MemoryBreakdown
from dsrun.zero.fragments import attach_fragments
from dsrun.zero.gathered import full_state_dict
from dsrun.zero.parameter_offload import DeepSpeedZeRoOffload  # stage 3's parameter side; alone without an optimizer

# stage -> "module:class", imported on first use so a stage's module is only loaded when it is chosen
STRATEGY_CLASSES: dict[int, str] = {
    0: "dsrun.zero.stage0:DataParallelStrategy",
    1: "dsrun.zero.partitioned:Stage1Strategy",
    2: "dsrun.zero.partitioned:Stage2Strategy",
    3: "dsrun.zero.stage3:Stage3Strategy",
}


def strategy_class(stage: int) -> type[ZeroStrategy]:
    """The strategy class of ``stage`` (``offload_optimizer`` is a placement each stage asks its store for)."""
    target = STRATEGY_CLASSES.get(stage)
    if target is None:
        raise ConfigError(Problem("zero_optimization.stage", f"got {stage!r}; allowed: 0, 1, 2, 3"))
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_zero_strategy(stage: int, ctx: StrategyContext) -> ZeroStrategy:
    """The strategy for ``stage``, built from ``ctx`` (module, optimizer, precision, bucket sizes…); it places
    its optimizer state where ``ctx.zero_config.offload_optimizer`` says (the device, host memory or NVMe).
    An optimizer that communicates by itself (the 1-bit family) attaches to it as an engine feature
    (``OneBitFeature``, :mod:`dsrun.features`)."""
    keep_states_in_bf16(ctx)
    strategy = strategy_class(stage)(ctx)
    attach_fragments(strategy)  # per-parameter views for dsrun.utils.safe_get_full_fp32_param & co.
    optimizer_wrappers.register(strategy)  # strategy.deepspeed_wrapper; isinstance(engine.optimizer, ...) follows it
    return strategy


def build_zero_inference(ctx: StrategyContext) -> DeepSpeedZeRoOffload:
    """Stage 3 without an optimizer (ZeRO-Inference): the parameter side alone, its 16-bit exports gathering the
    whole module. Stages 1-2 without an optimizer are refused, as DeepSpeed's engine asserts."""
    stage = int(ctx.zero_config.stage)
    if stage != 3:
        raise ConfigError(Problem("zero_optimization.stage", f"stage {stage} partitions an optimizer's states and "
                                  f"needs an optimizer (DeepSpeed: 'zero stage {stage} requires an optimizer')",
                                  "pass optimizer= to deepspeed.initialize or add an \"optimizer\" section; to run "
                                  "without one, use stage 3 (ZeRO-Inference) or 0"))
    return DeepSpeedZeRoOffload.for_inference(ctx, gather_state_dict=full_state_dict)


def keep_states_in_bf16(ctx: StrategyContext) -> None:
    """``bf16.bf16_optimizer_states``: a compiled CPU optimizer (``DeepSpeedCPUAdam`` & co.) keeps fp32 states and
    an fp32 copy of each bf16 parameter unless built with ``fp32_optimizer_states=False``; DeepSpeed's engine builds
    it so when the key is on, and so does this (torch's optimizers already keep states in the masters' dtype)."""
    if ctx.precision.optimizer_state_dtype == torch.bfloat16 and hasattr(ctx.optimizer, "fp32_optimizer_states"):
        ctx.optimizer.fp32_optimizer_states = False


__all__ = ["DeepSpeedZeRoOffload", "MemoryBreakdown", "STRATEGY_CLASSES", "StepOutcome", "StrategyContext", "ZeroStrategy",
           "build_zero_inference", "build_zero_strategy", "strategy_class"]
