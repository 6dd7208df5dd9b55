"""``deepspeed.inference.v2.modules.configs``: the configs inference modules are built from."""
from __future__ import annotations

from enum import Enum
from typing import Dict, Optional

from dsrun.config.config_utils import DeepSpeedConfigModel

from ..inference_utils import ActivationType, DtypeEnum, NormTypeEnum
from .ds_module import DSModuleConfig


class DSLinearConfig(DSModuleConfig):
    in_channels: int
    out_channels: int
    """Channels after gating: a gated activation's weight is ``[out_channels * 2, in_channels]``."""
    activation: ActivationType = ActivationType.IDENTITY
    input_dtype: DtypeEnum = DtypeEnum.fp16
    output_dtype: DtypeEnum = DtypeEnum.fp16


class PositionalEmbeddingType(Enum):
    none = "none"
    rotate_half = "rotate_half"
    rotate_every_other = "rotate_every_other"
    alibi = "alibi"


class RotateHalfConfig(DeepSpeedConfigModel):
    use_trained_freqs: bool = False
    """Use the inverse frequencies the model passes (``trained_freqs``) instead of ``theta_base``'s."""
    theta_base: float = 10_000.0
    rotate_dim: Optional[int] = None
    """Channels rotated; None: all of the head."""


class MaskingType(Enum):
    none = "none"
    causal = "causal"
    local = "local"
    symmetric = "symmetric"
    asymmetric = "asymmetric"


class DSSelfAttentionConfig(DSModuleConfig):
    n_heads_q: int
    n_heads_kv: int
    head_size: int
    max_sequences: int
    scale_factor: float = 1.0
    input_dtype: DtypeEnum = DtypeEnum.fp16
    output_dtype: DtypeEnum = DtypeEnum.fp16
    masking_type: MaskingType = MaskingType.causal
    masking_args: Dict = {}
    positional_embedding_type: PositionalEmbeddingType = PositionalEmbeddingType.none
    positional_embedding_config: Optional[RotateHalfConfig] = None


class DSNormConfig(DSModuleConfig):
    type: NormTypeEnum = NormTypeEnum.LayerNorm
    channels: int
    residual_dtype: DtypeEnum = DtypeEnum.fp16
    input_dtype: DtypeEnum = DtypeEnum.fp16
    output_dtype: DtypeEnum = DtypeEnum.fp16
    eps: float = 1e-5


class DSMoEConfig(DSModuleConfig):
    model_dim: int
    intermediate_features: int
    """Input features of the second expert linear (a gated activation's first linear has twice as many outputs)."""
    n_experts: int
    top_k: int = 1
    input_dtype: DtypeEnum = DtypeEnum.fp16
    output_dtype: DtypeEnum = DtypeEnum.fp16
    activation: ActivationType = ActivationType.IDENTITY
    normalize_scores: bool = False
    """Rescale each token's top-k gate scores to sum to 1."""


__all__ = ["DSMoEConfig", "ActivationType", "DSLinearConfig", "DSNormConfig", "DSSelfAttentionConfig", "MaskingType",
           "NormTypeEnum", "PositionalEmbeddingType", "RotateHalfConfig"]
