"""``deepspeed.inference.v2.modules.interfaces``: the module interfaces and their registries, by which a model
builds its layers from configs: linear, self attention, pre-norm, post-norm and MoE (the implementations are in
``implementations``). DeepSpeed's embedding and unembedding interfaces are not provided."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Dict, Optional, Tuple, Type

import torch

from ..inference_parameter import InferenceParameter
from ..ragged import RaggedBatchWrapper
from .configs import DSLinearConfig, DSMoEConfig, DSNormConfig, DSSelfAttentionConfig
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


class DSSelfAttentionBase(DSModuleBase):
    """``output = attention(q_k_v, kv_cache, batch)``: the batch's keys and values are written into the blocked
    KV cache, then its queries attend over it."""

    @staticmethod
    def config_class() -> Type[DSSelfAttentionConfig]:
        return DSSelfAttentionConfig

    def __init__(self, config: DSSelfAttentionConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV-cache block the implementation wants."""
        raise NotImplementedError()

    @property
    def q_block_size(self) -> int:
        """Query tokens per unit of work (it shapes the work split, not the cache)."""
        raise NotImplementedError()

    def build_atoms(self, ragged_batch: RaggedBatchWrapper) -> None:
        """Prepare the batch's work split before ``forward`` (nothing by default)."""

    def forward(self, q_k_v: torch.Tensor, kv_cache: torch.Tensor, batch: RaggedBatchWrapper,
                attention_mask: Optional[torch.Tensor] = None, attention_bias: Optional[torch.Tensor] = None,
                inv_freqs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError()


class DSSelfAttentionRegistry(DSModuleRegistryBase):
    registry: Dict = {}

    @staticmethod
    def associated_class() -> Type[DSModuleBase]:
        return DSSelfAttentionBase


class _NormBase(DSModuleBase):

    @staticmethod
    def config_class() -> Type[DSNormConfig]:
        return DSNormConfig

    def __init__(self, config: DSNormConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)

    @abstractmethod
    def transform_param(self, param: torch.Tensor) -> InferenceParameter:
        """The stored form of gamma or beta (both alike)."""
        ...


class DSPreNormBase(_NormBase):
    """``residual_out = residual + hidden_in`` (``residual`` when ``hidden_in`` is None), updated in place;
    ``hidden_out = norm(residual_out)``; returns ``(residual_out, hidden_out)``."""

    def forward(self, residual: torch.Tensor, hidden_states: Optional[torch.Tensor], gamma: torch.Tensor,
                beta: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError()


class DSPreNormRegistry(DSModuleRegistryBase):
    registry: Dict = {}

    @staticmethod
    def associated_class() -> Type[DSModuleBase]:
        return DSPreNormBase


class DSPostNormBase(_NormBase):
    """``residual, hidden_out = norm(residual + hidden_in)``, the residual updated in place (the two may alias)."""

    def forward(self, residual: torch.Tensor, hidden_states: torch.Tensor, gamma: torch.Tensor,
                beta: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError()


class DSPostNormRegistry(DSModuleRegistryBase):
    registry: Dict = {}

    @staticmethod
    def associated_class() -> Type[DSModuleBase]:
        return DSPostNormBase


class DSMoEBase(DSModuleBase):
    """``assignments = gate(hidden_states)``; ``output = ragged_linear_2(act(ragged_linear_1(hidden_states)))``
    over each token's experts, weighted by the gate."""

    @staticmethod
    def config_class() -> Type[DSMoEConfig]:
        return DSMoEConfig

    def __init__(self, config: DSMoEConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)

    @abstractmethod
    def transform_gate_param(self, param: torch.Tensor) -> InferenceParameter:
        """The stored form of the gate weight [experts, model_dim]."""
        ...

    @abstractmethod
    def transform_moe_mlp_1_param(self, param: torch.Tensor) -> InferenceParameter:
        """The stored form of the first expert linear's weight [experts, out, in] or bias [experts, out]."""
        ...

    @abstractmethod
    def transform_moe_mlp_2_param(self, param: torch.Tensor) -> InferenceParameter:
        """The stored form of the second expert linear's weight or bias."""
        ...

    def forward(self, hidden_states: torch.Tensor, gate_w: torch.Tensor, mlp_1_w: torch.Tensor,
                mlp_2_w: torch.Tensor, mlp_1_b: Optional[torch.Tensor] = None,
                mlp_2_b: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError()

    @property
    @abstractmethod
    def output(self) -> torch.Tensor:
        """The preallocated output buffer (``max_tokens`` rows)."""
        ...


class DSMoERegistry(DSModuleRegistryBase):
    registry: Dict = {}

    @staticmethod
    def associated_class() -> Type[DSModuleBase]:
        return DSMoEBase


__all__ = ["DSLinearBase", "DSLinearRegistry", "DSMoEBase", "DSMoERegistry", "DSPostNormBase", "DSPostNormRegistry",
           "DSPreNormBase", "DSPreNormRegistry", "DSSelfAttentionBase", "DSSelfAttentionRegistry"]
