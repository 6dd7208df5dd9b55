"""DeepSpeed's optimizer-wrapper classes as facts about dsrun's optimizer step.

DeepSpeed's engine wraps the optimizer according to the ZeRO stage and precision, and ``engine.optimizer`` is
the wrapper: ``DeepSpeedZeroOptimizer`` (stages 1-2), ``DeepSpeedZeroOptimizer_Stage3`` (stage 3),
``FP16_Optimizer`` (fp16 or bf16 without ZeRO over a fused Adam: the config's Adam/AdamW unless
``torch_adam``, a client ``FusedAdam``, 1-bit Adam or 0/1 Adam), ``FP16_UnfusedOptimizer`` (fp16 or bf16
without ZeRO over any other optimizer) and ``BF16_Optimizer`` (a bf16 model at ZeRO stage 1 accumulating in fp32
without offload, or bf16 in a pipeline without ZeRO), as DeepSpeed 0.19 chooses. In dsrun that role belongs to the ZeRO strategy (:mod:`dsrun.zero.strategies`), which steps the
client's own optimizer, and ``engine.optimizer`` stays that torch optimizer. These classes keep DeepSpeed's
names at DeepSpeed's module paths for code that branches on them: ``isinstance(engine.optimizer,
DeepSpeedZeroOptimizer)`` is true exactly when a ZeRO stage 1 or 2 strategy steps that optimizer, and so on,
so the answer is the one DeepSpeed gives for the same config. The wrapper's own attributes
(``single_partition_of_fp32_groups``, ``fp32_groups_flat``, ...) are not there: dsrun's fp32 master copies are
reached through ``dsrun.utils.safe_get_full_fp32_param`` and the strategy's ``masters``.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from dsrun.config import DSConfig


class _StrategyContext(Protocol):
    config: DSConfig

    @property
    def pipelined(self) -> bool: ...


class SteppingStrategy(Protocol):
    """What these facts read of a ZeRO strategy (:mod:`dsrun.zero.strategies`, a higher layer)."""

    optimizer: torch.optim.Optimizer
    stage: int
    ctx: _StrategyContext
    deepspeed_wrapper: str | None

# the strategy stepping each optimizer, registered as the engine builds it (dsrun.zero.strategies.build_zero_strategy)
_STEPPED_BY: "weakref.WeakKeyDictionary[torch.optim.Optimizer, SteppingStrategy]" = weakref.WeakKeyDictionary()
FUSED_ADAM_NAMES = ("adam", "adamw", "onebitadam", "zerooneadam")  # DeepSpeed builds these as fused kernels


def register(strategy: SteppingStrategy) -> None:
    """Record that ``strategy`` steps ``strategy.optimizer``, and which of DeepSpeed's wrappers it stands for
    (``strategy.deepspeed_wrapper``: checkpoints carry the keys that wrapper reads)."""
    strategy.deepspeed_wrapper = wrapper_name(strategy)
    _STEPPED_BY[strategy.optimizer] = strategy


def wrapper_name(strategy: SteppingStrategy) -> str | None:
    """The class DeepSpeed's engine would wrap this strategy's optimizer in, among the five kept here; None
    where DeepSpeed keeps the bare optimizer (fp32 without ZeRO)."""
    config, stage = strategy.ctx.config, strategy.stage
    accumulate = config.data_types.grad_accum_dtype  # None: the model's dtype
    if stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if stage in (1, 2):
        bf16_fp32_accumulation = (stage == 1 and config.precision == "bf16" and accumulate == "fp32"
                                  and config.zero_optimization.offload_optimizer_device == "none")
        return "BF16_Optimizer" if bf16_fp32_accumulation else "DeepSpeedZeroOptimizer"
    # without ZeRO DeepSpeed wraps fp16 and bf16 alike (its "DDP bf16")
    if config.precision == "fp32" or accumulate not in (None, config.precision):
        return None
    if config.precision == "bf16" and strategy.ctx.pipelined:
        return "BF16_Optimizer"
    from dsrun.ops.adam import FusedAdam

    name = (config.optimizer.type or "").lower() if config.optimizer is not None else ""
    fused = (name in FUSED_ADAM_NAMES and not config.optimizer.params.get("torch_adam", False)) \
        or isinstance(strategy.optimizer, FusedAdam)
    return "FP16_Optimizer" if fused else "FP16_UnfusedOptimizer"


ZERO_WRAPPERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer")
ALL_WRAPPERS = (*ZERO_WRAPPERS, "FP16_Optimizer", "FP16_UnfusedOptimizer")


class OptimizerWrapperKind(type):
    """Metaclass of the names: an instance is an optimizer that the matching strategy steps. A class stands for
    the wrappers in its ``deepspeed_wrappers`` (DeepSpeed's base classes ``ZeROOptimizer`` and
    ``DeepSpeedOptimizer`` stand for their subclasses), else for the one of its own name."""

    def _covers(cls) -> tuple[str, ...]:
        return vars(cls).get("deepspeed_wrappers", (cls.__name__,))

    def __instancecheck__(cls, obj: object) -> bool:
        try:
            strategy = _STEPPED_BY.get(obj)
        except TypeError:  # not weakly referenceable: no strategy steps it
            return False
        return strategy is not None and strategy.deepspeed_wrapper in cls._covers()

    def __subclasscheck__(cls, sub: type) -> bool:  # DeepSpeedZeroOptimizer is a ZeROOptimizer, as in DeepSpeed
        return isinstance(sub, OptimizerWrapperKind) and set(sub._covers()) <= set(cls._covers())

    def __call__(cls, *args: object, **kwargs: object) -> Any:
        raise TypeError(f"{cls.__name__} is built by the engine in DeepSpeed; in dsrun, dsrun.initialize builds the "
                        f"ZeRO strategy that plays its part (see {__name__})")
