"""Precision strategies: fp32, bf16 (fp32 master weights, or bf16 ones with ``bf16_master_weights_and_grads``;
no loss scaling) and fp16 (fp32 master weights, or fp16 ones with ``fp16_master_weights_and_grads``, with a static
or dynamic loss scale: DeepSpeed's loss scalers, :mod:`dsrun.precision.loss_scaler`).

The engine asks its precision strategy five things: which dtype the model runs in, which dtype the optimizer's
master weights and gradients are kept in, how to scale a loss before backward, whether a step must be checked
for inf/nan gradients, and what to do with the scale after a step (which may have overflowed). The ZeRO
strategy does the rest (master copies, unscaling).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dsrun.config.rules import keep_fp32_autocast_problem
from dsrun.precision.keep_fp32 import KEY as KEEP_KEY, Fp32Islands, cast_floats, keep_fp32, kept_names
from dsrun.utils.errors import ConfigError, Problem
from dsrun.precision.loss_scaler import DynamicLossScaler, LossScaler

if TYPE_CHECKING:
    from dsrun.config.precision import BF16Config, FP16Config


class PrecisionStrategy:
    """fp32: the model trains in fp32, losses are not scaled, nothing overflows."""

    name = "fp32"
    model_dtype = torch.float32
    # the dtype of the optimizer's master weights and gradients, and so of the states a torch optimizer keeps
    # beside them (bf16 with bf16.bf16_master_weights_and_grads; fp32 otherwise)
    master_dtype = torch.float32
    optimizer_state_dtype = torch.float32  # bf16 with bf16.bf16_optimizer_states
    checks_overflow = False
    scales_loss = False  # whether backward needs the loss multiplied by a loss scale (only engine.backward does)

    @property
    def needs_master_weights(self) -> bool:
        """True when the optimizer must step master copies in another dtype rather than the model's own
        parameters (a 16-bit model with fp32 masters)."""
        return self.model_dtype != self.master_dtype

    @property
    def loss_scale(self) -> float:
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The forward's inputs, as the model should see them (fp16 ``auto_cast`` casts float tensors)."""
        return args, kwargs

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step with whether its gradients overflowed."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        return None


class BF16Precision(PrecisionStrategy):
    """bf16: the model runs in bfloat16; fp32 master weights; no loss scaling (bf16 has fp32's range).
    ``check_overflow``: skip a step whose gradients hold inf/nan (DeepSpeed 0.19's ``bf16.check_grad_overflow``,
    on by default, which its ZeRO-1/2 optimizer applies; its stage-0 bf16 optimizer and stage 3 do not check).
    ``bf16_masters`` (``bf16.bf16_master_weights_and_grads``, ZeRO 1-3): the masters and their gradients are
    bf16; ``bf16_states`` (``bf16.bf16_optimizer_states``): the optimizer's states too. The config layer allows
    the first only with the second (docs/precision.md), so no fp32 copy of anything is kept."""

    name = "bf16"
    model_dtype = torch.bfloat16

    def __init__(self, check_overflow: bool = False, bf16_masters: bool = False, bf16_states: bool = False):
        self.checks_overflow = check_overflow
        self.master_dtype = torch.bfloat16 if bf16_masters else torch.float32
        self.optimizer_state_dtype = torch.bfloat16 if bf16_states else torch.float32


class FP16Precision(PrecisionStrategy):
    """fp16: the model runs in float16; fp32 master weights; the loss is multiplied by the loss scale before
    backward, gradients are divided by it before the step, and a step whose gradients hold inf/nan on any
    rank is skipped on every rank. ``fp16_masters`` (``fp16.fp16_master_weights_and_grads``): fp16 masters and
    master gradients instead (DeepSpeed's; the offloaded stores keep them, docs/precision.md)."""

    name = "fp16"
    model_dtype = torch.float16
    checks_overflow = True
    scales_loss = True

    def __init__(self, scaler: DynamicLossScaler | LossScaler, auto_cast: bool = False, fp16_masters: bool = False):
        self.scaler = scaler
        self.auto_cast = auto_cast
        # fp16.fp16_master_weights_and_grads (ZeRO 1-3 with CPU optimizer offload and its CPU Adam, which the
        # config layer requires): the host masters and their gradients are fp16, the Adam moments stay fp32
        self.master_dtype = torch.float16 if fp16_masters else torch.float32

    def prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.auto_cast:
            return args, kwargs
        return cast_floats(args, self.model_dtype), cast_floats(kwargs, self.model_dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.scaler.loss_scale

    def update(self, overflow: bool) -> None:
        self.scaler.update_scale(overflow)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict(), "dynamic_loss_scale": self.scaler.dynamic}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "loss_scaler" in sd:
            self.scaler.load_state_dict(sd["loss_scaler"])


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def cast_model(module: torch.nn.Module, dtype: torch.dtype, buffer_dtype: str | None = None,
               keep_in_fp32: str | list[str] = "auto", master_dtype: torch.dtype = torch.float32,
               autocast: bool = False) -> Fp32Islands | None:
    """Cast ``module`` to the 16-bit ``dtype`` (``module.to``, buffers too). ``data_types.buffer_dtype``
    (``fp32``/``fp16``/``bf16``) set: every floating-point buffer is then cast to it from its loaded value
    (DeepSpeed's ``_cast_module_mixed_precision``: with ``fp32`` a rotary table stays exact, never rounded
    through ``dtype``). The parameters and buffers ``keep_in_fp32`` names (``data_types.keep_in_fp32_modules``,
    :mod:`dsrun.precision.keep_fp32`) then get their loaded values back in fp32; the modules a list makes wholly
    fp32 get the forward hooks returned (None for "auto", which the model's own code serves). The masters'
    ``master_dtype`` must then be fp32 (16-bit masters would step the kept parameters in 16 bits), and
    ``torch_autocast`` off (``autocast``: it would run the kept modules' forward in 16 bits)."""
    kept = kept_names(module, keep_in_fp32, dtype)
    if kept and autocast:
        raise ConfigError(keep_fp32_autocast_problem(""))
    if kept and master_dtype != torch.float32:
        raise ConfigError(Problem(KEEP_KEY, f"keeps {len(kept)} parameters and buffers fp32, but the master weights "
                                  f"are {str(master_dtype).replace('torch.', '')} (bf16.bf16_master_weights_and_grads "
                                  "or fp16.fp16_master_weights_and_grads) and would step them in 16 bits",
                                  "turn the 16-bit masters off, or set keep_in_fp32_modules: []"))
    # module.to replaces the buffer tensors: these keep the loaded values
    loaded = dict(module.named_buffers(remove_duplicate=False))
    loaded.update((n, p.detach().clone()) for n, p in module.named_parameters(remove_duplicate=False) if n in kept)
    module.to(dtype=dtype)
    if buffer_dtype is not None:
        target = _DTYPES[buffer_dtype]
        for name, buffer in module.named_buffers():
            if loaded[name].is_floating_point():
                buffer.data = loaded[name].to(device=buffer.device, dtype=target)
    keep_fp32(module, kept, loaded)
    return Fp32Islands(module, kept, dtype) if kept and keep_in_fp32 != "auto" else None


def build_precision(fp16: FP16Config | None = None, bf16: BF16Config | None = None,
                    zero_stage: int = 0) -> PrecisionStrategy:
    """The strategy for a config's ``fp16``/``bf16`` sections (objects with DeepSpeed's key names, or None) at
    ZeRO stage ``zero_stage``."""
    if fp16 is not None and getattr(fp16, "enabled", False):
        loss_scale = float(getattr(fp16, "loss_scale", 0.0) or 0.0)
        auto_cast = bool(getattr(fp16, "auto_cast", False))
        # the config layer allows it only at ZeRO 1-3 with CPU optimizer offload (dsrun/config/rules.py)
        masters = bool(getattr(fp16, "fp16_master_weights_and_grads", False)) and zero_stage in (1, 2, 3)
        if loss_scale > 0:
            return FP16Precision(LossScaler(loss_scale), auto_cast, masters)
        return FP16Precision(DynamicLossScaler(
            init_scale=2.0 ** int(getattr(fp16, "initial_scale_power", 16)),
            scale_window=int(getattr(fp16, "loss_scale_window", 1000)),
            min_scale=float(getattr(fp16, "min_loss_scale", 1)),
            delayed_shift=int(getattr(fp16, "hysteresis", 2)),
            consecutive_hysteresis=bool(getattr(fp16, "consecutive_hysteresis", False)),
            raise_error_at_min_scale=False), auto_cast, masters)  # dsrun keeps training at the minimum scale
    if bf16 is not None and getattr(bf16, "enabled", False):
        check = bool(getattr(bf16, "check_grad_overflow", True))
        # the config layer allows it only at ZeRO 1-3 with bf16_optimizer_states (dsrun/config/rules.py)
        masters = bool(getattr(bf16, "bf16_master_weights_and_grads", False)) and zero_stage in (1, 2, 3)
        states = bool(getattr(bf16, "bf16_optimizer_states", False)) and masters
        return BF16Precision(check_overflow=check and zero_stage in (1, 2), bf16_masters=masters, bf16_states=states)
    return PrecisionStrategy()
