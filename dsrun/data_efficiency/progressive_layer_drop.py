"""Progressive layer drop (PLD): the global keep probability θ(t) the engine hands to the model.

DeepSpeed's ``deepspeed.runtime.progressive_layer_drop.ProgressiveLayerDrop`` (Zhang & He, "Accelerating
Training of Transformer-Based Language Models with Progressive Layer Dropping", NeurIPS 2020):
``θ(t) = (1 - θ̄)·exp(-γ·t) + θ̄``, which starts at 1 (every layer kept) and decays towards ``θ̄ = theta``
at rate ``gamma``. The engine updates it at every optimizer step and passes ``progressive_layer_drop=True,
pld_theta=θ`` to the model's forward while training; the model decides which layers to skip (the built-in GPT:
``dsrun.models.gpt.pld_keep_probabilities``, the paper's distribution along depth).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def pld_theta(step: float, theta: float, gamma: float) -> float:
    """``θ(step) = (1 - theta)·exp(-gamma·step) + theta`` (numpy's exp, as DeepSpeed computes it)."""
    return float((1.0 - theta) * np.exp(-gamma * step) + theta)


class ProgressiveLayerDrop:
    """θ(t) for the engine; ``theta`` (θ̄, the final keep probability) and ``gamma`` (the decay rate)."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        self.theta = float(theta)
        self.gamma = float(gamma)
        self.current_theta = 1.0

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments the engine adds to the model's forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = pld_theta(global_step, self.theta, self.gamma)

    def state_dict(self) -> dict[str, float]:
        return {"theta": self.theta, "gamma": self.gamma, "current_theta": self.current_theta}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.current_theta = float(state["current_theta"])
