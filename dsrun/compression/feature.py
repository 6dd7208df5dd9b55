"""How the engine runs compression: prepare the model in ``initialize``, step after each optimizer step,
and carry the schedule position in checkpoints.

``dsrun.initialize`` calls :func:`prepare_for_training` before it builds the optimizer (so learnable
pruning scores are optimized like any parameter) and attaches a :class:`CompressionFeature` to the engine;
the engine calls :meth:`CompressionFeature.after_step` after every optimizer step and checkpoints save
:meth:`CompressionFeature.state_dict` under the ``compression`` key.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .compress import TECHNIQUES, init_compression, is_enabled, plan_of
from .eigenvalue import Eigenvalue
from .moq import MoQ, overwrite_with_quantized
from .scheduler import compression_scheduler


def _wants_compression(ds_config: Any) -> bool:
    return is_enabled(ds_config.compression_training)


def prepare_for_training(model: nn.Module, ds_config: Any, model_parameters: Any = None,
                         optimizer: Any = None) -> Any:
    """Apply ``compression_training`` to ``model`` unless the caller already did (``init_compression``);
    returns ``model_parameters`` with any new learnable scores added (a client optimizer gets them as a
    new parameter group)."""
    if not _wants_compression(ds_config) or plan_of(model) is not None:
        return model_parameters
    before = {id(p) for p in model.parameters()}
    init_compression(model, ds_config)
    added = [p for p in model.parameters() if id(p) not in before]
    if not added:
        return model_parameters
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.add_param_group({"params": added})
        return model_parameters
    if model_parameters is None or not isinstance(model_parameters, (list, tuple)):
        return model_parameters  # None or a generator: read after this, so it already yields the scores
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return items + [{"params": added}]
    return items + added


class CompressionFeature:
    """The compression scheduler, stored-weight quantization and MoQ of one engine."""

    def __init__(self, module: nn.Module, ds_config: Any):
        self.module = module
        plan = plan_of(module)
        has_techniques = plan is not None and any(t in plan.groups for t in TECHNIQUES)
        self.scheduler = compression_scheduler(module) if has_techniques else None
        self.stored = [m for _, m in (self.scheduler.modules if self.scheduler else [])
                       if m.ds_compression.weight is not None and not m.ds_compression.weight.in_forward]
        qt = ds_config.quantize_training
        self.eigenvalue = (Eigenvalue(module, ds_config.eigenvalue)
                           if qt.enabled and ds_config.eigenvalue.enabled else None)
        self.moq = MoQ(module, qt, self.eigenvalue) if qt.enabled else None
        if self.scheduler is not None:
            self.scheduler.step(step_zero_check=True)
            self._quantize_stored()
        if self.moq is not None:
            self.moq.apply()

    @classmethod
    def attach(cls, engine: Any) -> "CompressionFeature | None":
        config = engine._config
        if plan_of(engine.module) is None and not config.quantize_training.enabled:
            return None
        return cls(engine.module, config)

    def _quantize_stored(self) -> None:
        overwrite_with_quantized(
            (m.weight, m.ds_compression.weight.spec(), m.ds_compression.weight.mixed_share)
            for m in self.stored if m.ds_compression.weight.bits is not None)

    def after_step(self, overflow: bool) -> None:
        """One optimizer step was taken (or skipped, on overflow: then nothing advances)."""
        if overflow:
            return
        if self.scheduler is not None:
            self.scheduler.step()
            self._quantize_stored()
        if self.moq is not None:
            due = self.eigenvalue.due() if self.eigenvalue is not None else False
            values = self.eigenvalue.compute() if due and self.moq.switch_due() else None
            self.moq.step(values)

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
