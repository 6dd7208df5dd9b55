"""The ``offload_optimizer`` settings a ZeRO strategy acts on, checked once when the strategy is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import torch

from dsrun.config.optim import offload_optimizer_problem
from dsrun.config.zero import AIOConfig, ZeroConfig
from dsrun.utils.errors import ConfigError, Problem, ZeRORuntimeException
from dsrun.utils.pin_memory import get_active_native_pinned_memory, get_native_pinned_memory
from dsrun.utils.pin_memory_tracker import track_pinned_memory

if TYPE_CHECKING:
    from dsrun.ops.cpu_optimizer import CPUOptimizer

KEY = "zero_optimization.offload_optimizer"

# A CPU-offloaded flat partition is stepped in tiles of at most this many elements, so the transfer of one
# tile's gradient (and the write-back of its 16-bit copy) overlaps the update of the next.
CPU_TILE_ELEMENTS = 1 << 22


class _Precision(Protocol):
    model_dtype: torch.dtype


class OffloadContext(Protocol):
    """What the offloaded stores read of a ZeRO strategy's context (``dsrun.zero.strategies.StrategyContext``)."""

    device: torch.device
    optimizer: torch.optim.Optimizer

    @property
    def precision(self) -> _Precision: ...

    @property
    def zero_config(self) -> ZeroConfig: ...

    @property
    def aio_config(self) -> AIOConfig: ...

    @property
    def force_ds_cpu_optimizer(self) -> bool: ...


@dataclass
class OffloadOptimizerSettings:
    """``zero_optimization.offload_optimizer`` (+ ``aio``, ``sub_group_size``) as the strategies use them."""

    device: str  # "cpu" | "nvme"
    nvme_path: str | None
    pin_memory: bool
    buffer_count: int
    fast_init: bool
    ratio: float
    aio: AIOConfig | Mapping[str, Any] | None
    sub_group_size: int
    force_ds_cpu_optimizer: bool
    # nvme: step each sub-group during backward once its gradient is final (dsrun/offload/backward_step.py)
    super_offload: bool = False

    @classmethod
    def from_context(cls, ctx: OffloadContext) -> "OffloadOptimizerSettings | None":
        """The settings of ``ctx.zero_config.offload_optimizer`` (every default from the config schema); None
        when the optimizer is not offloaded."""
        zero = ctx.zero_config
        section = zero.offload_optimizer
        if section.device == "none":
            return None
        return cls(device=str(section.device), nvme_path=section.nvme_path, pin_memory=bool(section.pin_memory),
                   buffer_count=int(section.buffer_count), fast_init=bool(section.fast_init),
                   ratio=float(section.ratio), aio=ctx.aio_config, sub_group_size=max(1, int(zero.sub_group_size)),
                   force_ds_cpu_optimizer=ctx.force_ds_cpu_optimizer, super_offload=bool(section.super_offload))

    @property
    def pinned(self) -> bool:
        """Host buffers are page-locked: asked for, and an accelerator exists to transfer from them."""
        return self.pin_memory and torch.cuda.is_available()


class HostBuffers:
    """The host tensors one store allocates, page-locked as ``offload_optimizer.pin_memory`` asks: by torch where
    an accelerator exists to copy from them, or by DeepSpeed's native manager under ``DS_PIN_MEMORY_BACKEND=native``
    (any device, docs/offload.md); :meth:`release` (the store's ``close``, so ``engine.destroy()``) releases
    the native pins, as DeepSpeed's optimizer does at destroy."""

    def __init__(self, settings: OffloadOptimizerSettings) -> None:
        self.settings = settings
        self.native: list[torch.Tensor] = []  # the buffers the native manager pinned, until released

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D host tensor."""
        pins = get_active_native_pinned_memory() if self.settings.pin_memory else None
        if pins is None:
            return torch.empty(int(numel), dtype=dtype, pin_memory=self.settings.pinned)
        shape_only = torch.empty(int(numel), dtype=dtype, device="meta")  # no bytes: nothing to copy
        track_pinned_memory(shape_only.nbytes)
        buffer = pins.pin(shape_only, make_copy=False)
        self.native.append(buffer)
        return buffer

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype).zero_()

    def release(self) -> None:
        pins = get_native_pinned_memory()  # the manager that pinned them, whatever the environment says now
        for buffer in self.native:
            pins.unpin(buffer)
        self.native.clear()


def require_cpu_optimizer(optimizer: torch.optim.Optimizer, settings: OffloadOptimizerSettings) -> CPUOptimizer | None:
    """The offloaded step needs one of DeepSpeed's CPU optimizers (DeepSpeedCPUAdam/Adagrad/Lion); returns it,
    or None when ``zero_force_ds_cpu_optimizer: false`` lets another optimizer step the host tensors (CPU
    offload only). Raises a one-line ConfigError otherwise (DeepSpeed's ZeRORuntimeException)."""
    from dsrun.ops.cpu_optimizer import CPUOptimizer

    if isinstance(optimizer, CPUOptimizer):
        return optimizer
    problem = offload_optimizer_problem(type(optimizer).__name__, settings.device, settings.force_ds_cpu_optimizer)
    if problem is not None:  # the rule config --validate runs on optimizer.type; DeepSpeed's exception class
        raise ZeRORuntimeException(problem)
    return None


def require_master_optimizer(cpu_optimizer: CPUOptimizer | None, master_dtype: torch.dtype) -> None:
    """fp16 host masters (``fp16.fp16_master_weights_and_grads``) are stepped by DeepSpeed's CPU Adam only, as
    DeepSpeed asserts ("Master weights feature requires ZeRO-Offload with DeepSpeedCPUAdam"); a one-line
    ConfigError for another optimizer object (the config rule catches an ``optimizer.type``)."""
    from dsrun.ops.adam import DeepSpeedCPUAdam

    if master_dtype != torch.float32 and not isinstance(cpu_optimizer, DeepSpeedCPUAdam):
        raise ConfigError(Problem("fp16.fp16_master_weights_and_grads", "fp16 masters are stepped by ZeRO-Offload's "
                                  f"DeepSpeedCPUAdam (as DeepSpeed requires); the optimizer is "
                                  f"{type(cpu_optimizer).__name__}", "use optimizer type Adam or AdamW, or remove "
                                  "the key"))
