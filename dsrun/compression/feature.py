"""Compression as an engine feature (:mod:`dsrun.features`): it compresses the model before the
optimizer sees its parameters (``wrap_model``), steps its scheduler and MoQ after each optimizer step
(``after_step``) and carries the schedule's position in checkpoints under the ``compression`` key.
"""
from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from dsrun.config import DSConfig
from dsrun.features import Feature

from .compress import TECHNIQUES, init_compression, is_enabled, plan_of
from .eigenvalue import Eigenvalue
from .moq import MoQ, overwrite_with_quantized
from .scheduler import compression_scheduler


class _Engine(Protocol):
    """What the feature reads of the engine it attaches to."""

    module: nn.Module


class CompressionFeature(Feature):
    """The compression scheduler, stored-weight quantization and MoQ of one engine."""

    name = "compression"

    def __init__(self, ds_config: DSConfig):
        self.config = ds_config
        self.module: nn.Module | None = None
        self.scheduler: compression_scheduler | None = None
        self.stored: list[nn.Module] = []
        self.eigenvalue: Eigenvalue | None = None
        self.moq: MoQ | None = None

    @classmethod
    def build(cls, config: DSConfig) -> "CompressionFeature | None":
        return cls(config)  # whether it acts depends on the model too (init_compression may have run): attach

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Apply ``compression_training`` unless the caller already did (``init_compression``); learnable
        pruning scores it adds are optimized like any parameter."""
        if is_enabled(self.config.compression_training) and plan_of(model) is None:
            init_compression(model, self.config)
        return model

    def attach(self, engine: _Engine) -> None:
        module, qt = engine.module, self.config.quantize_training
        if plan_of(module) is None and not qt.enabled:
            return
        self.module = module
        plan = plan_of(module)
        has_techniques = plan is not None and any(t in plan.groups for t in TECHNIQUES)
        self.scheduler = compression_scheduler(module) if has_techniques else None
        self.stored = [m for _, m in (self.scheduler.modules if self.scheduler else [])
                       if m.ds_compression.weight is not None and not m.ds_compression.weight.in_forward]
        self.eigenvalue = (Eigenvalue(module, self.config.eigenvalue)
                           if qt.enabled and self.config.eigenvalue.enabled else None)
        self.moq = MoQ(module, qt, self.eigenvalue) if qt.enabled else None
        if self.scheduler is not None:
            self.scheduler.step(step_zero_check=True)
            self._quantize_stored()
        if self.moq is not None:
            self.moq.apply()

    @property
    def active(self) -> bool:
        return self.module is not None

    def _quantize_stored(self) -> None:
        overwrite_with_quantized(
            (m.weight, m.ds_compression.weight.spec(), m.ds_compression.weight.mixed_share)
            for m in self.stored if m.ds_compression.weight.bits is not None)

    def after_step(self, overflow: bool) -> None:
        """One optimizer step was taken (or skipped, on overflow: then nothing advances)."""
        if overflow or not self.active:
            return
        if self.scheduler is not None:
            self.scheduler.step()
            self._quantize_stored()
        if self.moq is not None:
            due = self.eigenvalue.due() if self.eigenvalue is not None else False
            values = self.eigenvalue.compute() if due and self.moq.switch_due() else None
            self.moq.step(values)

    def checkpoint_entries(self) -> dict[str, Any]:
        """The schedule's position under the ``compression`` key."""
        return {"compression": self.state_dict()} if self.active else {}

    def load_checkpoint_entries(self, states: dict[str, Any]) -> None:
        if self.active and states.get("compression"):
            self.load_state_dict(states["compression"])

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "moq": self.moq.state_dict() if self.moq else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
            self._quantize_stored()
        if self.moq is not None and state.get("moq"):
            self.moq.load_state_dict(state["moq"])
            self.moq.apply()  # the loaded 16-bit weights come from the fp32 masters: quantize them again
