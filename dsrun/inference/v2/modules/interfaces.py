"""``deepspeed.inference.v2.modules.interfaces``: the linear interface and its registry (the implementation
here is the FP6 quantized linear). DeepSpeed's other interfaces (attention, embedding, norms, MoE, unembedding)
have only CUDA implementations and are not provided."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Dict, Optional, Type

import torch

from ..inference_parameter import InferenceParameter
from .configs import DSLinearConfig
from .ds_module import DSModuleBase, DSModuleRegistryBase


class DSLinearBase(DSModuleBase):
    """``hidden_out = activation(hidden_in @ weight.T + bias)``; the weight's stored form is the implementation's
    (``transform_param`` makes it)."""

    @staticmethod
    def config_class() -> Type[DSLinearConfig]:
        return DSLinearConfig

    def __init__(self, config: DSLinearConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)

    @abstractmethod
    def transform_param(self, param: torch.Tensor) -> InferenceParameter:
        ...

    def forward(self, hidden_states: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError()

    @property
    @abstractmethod
    def output(self) -> torch.Tensor:
        """The preallocated output buffer (``max_tokens`` rows)."""
        ...


class DSLinearRegistry(DSModuleRegistryBase):
    registry: Dict = {}

    @staticmethod
    def associated_class() -> Type[DSModuleBase]:
        return DSLinearBase


__all__ = ["DSLinearBase", "DSLinearRegistry"]
