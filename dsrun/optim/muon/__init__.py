"""Muon (``optimizer.type: Muon``), DeepSpeed's ``runtime/zero/muon``: Muon for the 2-D hidden weights, an
auxiliary Adam for embeddings, the output head, biases and norms, at ZeRO stages 0-3. The arithmetic is in
:mod:`.newton_schulz`, the optimizer and DeepSpeed's parameter split in :mod:`.optimizer`, the whole-matrix
update under ZeRO in :mod:`.zero`; docs/muon.md says what it costs and how it trains."""
from __future__ import annotations

from typing import Any

import torch

from dsrun.config import DSConfig
from dsrun.features import Feature
from dsrun.utils.errors import ConfigError, Problem

from .newton_schulz import (NS_METHODS, adam_update, muon_update, zeropower_via_gram_newtonschulz,
                            zeropower_via_newtonschulz5)
from .optimizer import (MuonWithAuxAdam, SingleDeviceMuonWithAuxAdam, muon_param_groups,
                        set_optimizer_flags)
from .zero import ZeroMuon

MUON_NAMES = frozenset({"muon"})  # optimizer.type, lower-cased


class MuonFeature(Feature):
    """With ``optimizer.type: Muon`` marks the model's parameters ``use_muon`` by DeepSpeed's rule before the
    optimizer is built (as ``deepspeed.initialize`` does); once the engine is built, binds a
    :class:`MuonWithAuxAdam` (the config's or the client's) to the ZeRO strategy (:class:`ZeroMuon`), its
    momentum in memory or, at ZeRO-3 with NVMe optimizer offload, swapped unless ``momentum_in_memory``
    (``zero_optimization.save_muon_momentum_buffer_in_memory``)."""

    name = "muon"

    def __init__(self, marks_parameters: bool, momentum_in_memory: bool = False):
        self.marks_parameters = marks_parameters
        self.momentum_in_memory = momentum_in_memory
        self.binding: ZeroMuon | None = None

    @classmethod
    def build(cls, config: DSConfig) -> "MuonFeature":
        optimizer = config.optimizer
        # the key applies to a client's MuonWithAuxAdam too (attach binds whichever the strategy steps)
        return cls(optimizer is not None and (optimizer.type or "").lower() in MUON_NAMES,
                   config.zero_optimization.save_muon_momentum_buffer_in_memory)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.marks_parameters:
            set_optimizer_flags(model)
        return model

    def attach(self, engine: Any) -> None:
        strategy = engine.strategy
        if strategy is not None and isinstance(strategy.optimizer, MuonWithAuxAdam):
            if any(not getattr(p, "allreduce", True) for p in engine.module.parameters()):  # DeepSpeed's expert mark
                raise ConfigError(Problem(
                    "optimizer.type", "is Muon, but the model has MoE expert parameters, and dsrun's Muon is not "
                    "proved against a reference on them (each expert-parallel rank's updates, the clip norm across "
                    "them)", "train a MoE model with Adam or AdamW"))
            self.binding = ZeroMuon(strategy, self.momentum_in_memory)

    def metrics(self) -> dict[str, float]:
        """``update_norm``: the Frobenius norm of the last step's Muon updates together (before clipping)."""
        if self.binding is None:
            return {}
        return {"update_norm": self.binding.last_update_sq_norm ** 0.5}

    def close(self) -> None:
        if self.binding is not None:
            self.binding.close()
            self.binding = None


__all__ = ["MUON_NAMES", "MuonFeature", "MuonWithAuxAdam", "NS_METHODS", "SingleDeviceMuonWithAuxAdam",
           "ZeroMuon", "adam_update", "muon_param_groups", "muon_update", "set_optimizer_flags",
           "zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5"]
