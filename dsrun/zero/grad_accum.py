"""``data_types.grad_accum_dtype`` and ``bf16.immediate_grad_update``: the dtype gradients accumulate in over the
micro-steps of one optimizer step, and when each micro-step's gradient joins that accumulator.

Without the key dsrun accumulates where its strategies keep gradients anyway (``DSConfig.native_grad_accum_dtype``):
in the model's dtype at stages 0-1 (autograd adds into the flat ``.grad`` buffers), in the masters' dtype at stages
2-3 (the partition accumulators: fp32, or bf16 with bf16 master state). A key naming another dtype acts as in
DeepSpeed 0.19, whose ZeRO optimizers take it as ``gradient_accumulation_dtype``:

* **stage 0**: refused by the config layer (DeepSpeed raises NotImplementedError for a mix without ZeRO).
* **stage 1**: a whole accumulator in that dtype beside the model-dtype ``.grad`` buffers, which then hold one
  micro-step only (:class:`SeparateAccumulator`); the boundary reduces the accumulator into a partition of that
  dtype. A bf16 model accumulating in fp32 is DeepSpeed's ``BF16_Optimizer``: its fp32 accumulator is reduced in
  fp32, and ``immediate_grad_update`` adds each gradient from its parameter's hook (else all of them once
  backward is over). Any other mix is DeepSpeed's ZeRO-1 ``grad_accum`` attribute: filled from each hook, reduced
  in the model's dtype. ``communication_data_type`` overrides the reduction dtype either way.
* **stages 2-3**: the partition accumulators (stage 2's, stage 3's sub-group gradients) are kept in that dtype;
  the step reads a copy in the masters' dtype when the two differ (DeepSpeed casts it there too), made at the
  step and dropped at ``zero_grad``. Every gradient is added from its hook at these stages.

The :class:`GradientAccumulationFeature` supplies the :class:`GradientAccumulation` the engine hands to its ZeRO
strategy (``StrategyContext.accumulation``, as a feature's sharding policy is handed over); nothing in the step
names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsrun.features import Feature
from dsrun.zero.layout import FlatGroup

if TYPE_CHECKING:
    from dsrun.config import DSConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class GradientAccumulation:
    """How a ZeRO strategy accumulates gradients when it is not its native way."""

    dtype: torch.dtype  # the dtype gradients accumulate in over micro-steps
    immediate: bool = True  # stage 1: each gradient joins the accumulator from its hook (else after backward)
    reduce_dtype: torch.dtype | None = None  # stage 1: the dtype the accumulator is reduced in (None: the model's)

    @classmethod
    def from_config(cls, config: "DSConfig") -> "GradientAccumulation | None":
        """The accumulation ``config`` asks for, or None where it is the strategy's native one."""
        asked = config.data_types.grad_accum_dtype
        if asked is None or asked == config.native_grad_accum_dtype:
            return None
        bf16_optimizer = config.precision == "bf16" and asked == "fp32"  # DeepSpeed's BF16_Optimizer at stage 1
        communication = config.communication_data_type
        reduce_dtype = DTYPES[str(communication).lower()] if communication else (DTYPES["fp32"] if bf16_optimizer
                                                                                  else None)
        return cls(dtype=DTYPES[asked], immediate=bool(config.bf16.immediate_grad_update) or not bf16_optimizer,
                   reduce_dtype=reduce_dtype)


class GradientAccumulationFeature(Feature):
    """Supplies the :class:`GradientAccumulation` of ``data_types.grad_accum_dtype`` (with
    ``bf16.immediate_grad_update``) to the ZeRO strategy the engine builds."""

    name = "grad_accum"

    def __init__(self, accumulation: GradientAccumulation):
        self.accumulation = accumulation

    @classmethod
    def build(cls, config: "DSConfig") -> "GradientAccumulationFeature | None":
        accumulation = GradientAccumulation.from_config(config)
        return cls(accumulation) if accumulation is not None else None

    def gradient_accumulation(self) -> GradientAccumulation:
        return self.accumulation


class SeparateAccumulator:
    """Stage 1's whole accumulator in the accumulation dtype, one flat tensor per group beside the model-dtype
    gradient buffers (``FlatGradients``): each micro-step's gradient is added here and its ``.grad`` zeroed, so
    the flat buffers hold one micro-step and this tensor the sum, rounded once per micro-step in its own dtype."""

    def __init__(self, groups: list[FlatGroup], accumulation: GradientAccumulation, flats: list[torch.Tensor],
                 views: list[list[torch.Tensor]]):
        self.immediate = accumulation.immediate
        self.flats = flats  # the model-dtype gradient buffers (FlatGradients.flats) and their per-parameter views
        self.views = views
        self.sums = [torch.zeros(g.padded_numel, dtype=accumulation.dtype, device=g.flat_param.device)
                     for g in groups]
        self._offsets = [(list(g.offsets), list(g.numels)) for g in groups]

    def take_parameter(self, gi: int, pi: int) -> None:
        """``immediate``: parameter ``pi`` of group ``gi`` has its gradient for this micro-step (its hook fired)."""
        if self.immediate:
            offset, numel = self._offsets[gi][0][pi], self._offsets[gi][1][pi]
            self.sums[gi][offset:offset + numel].add_(self.flats[gi][offset:offset + numel])
            self.views[gi][pi].zero_()

    def take_range(self, gi: int, lo: int, hi: int) -> torch.Tensor:
        """Fold elements [lo, hi) of group ``gi``'s gradient buffer into the sum (what no hook took: after
        backward without ``immediate``, or a gradient assigned outside backward); the sum's slice."""
        total = self.sums[gi][lo:hi]
        total.add_(self.flats[gi][lo:hi])
        self.flats[gi][lo:hi].zero_()
        return total

    def take_all(self) -> None:
        """After a backward that reduced nothing: fold every gradient no hook took."""
        if not self.immediate:
            for gi, flat in enumerate(self.flats):
                self.take_range(gi, 0, flat.numel())

    def zero(self) -> None:
        for total in self.sums:
            total.zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sums)
