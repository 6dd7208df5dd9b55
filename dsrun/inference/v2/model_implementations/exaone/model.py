"""EXAONE 4.0 and 4.5 for DeepSpeed's inference v2 (``deepspeed.inference.v2.model_implementations.exaone4.model``
and ``exaone4_5.model``): their shapes and dtypes read from the Hugging Face config, EXAONE 4.5's Llama-3 scaled
rotary frequencies, its sequence cap and its per-layer attention choice. Building one needs DeepSpeed's CUDA
attention and norms and is refused (:class:`..inference_transformer_base.DSTransformerModelBase`)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

import torch

from dsrun.accelerator import get_accelerator

from ...config_v2 import RaggedInferenceEngineConfig
from ...inference_utils import ActivationType, DtypeEnum, NormTypeEnum
from ...modules import heuristics
from ...modules.configs import DSSelfAttentionConfig, PositionalEmbeddingType, RotateHalfConfig
from ...ragged import BaseSequenceDescriptor
from ..inference_transformer_base import DSTransformerModelBase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig

_ACTIVATIONS = {"silu": ActivationType.SiGLU, "gelu": ActivationType.GEGLU, "relu": ActivationType.ReGLU}


def _activation_dtype(dtype: Union[torch.dtype, str, None]) -> DtypeEnum:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), dtype)
    if dtype == torch.float16:
        return DtypeEnum.fp16
    if dtype == torch.bfloat16:
        return DtypeEnum.bf16
    raise NotImplementedError("Only fp16 and bf16 are supported")


class Exaone4InferenceModel(DSTransformerModelBase):
    """EXAONE 4.0: post-norm blocks, RMSNorm on each head's q and k, gated MLP, grouped-query attention."""

    @property
    def max_sequence_length(self) -> int:
        return self._config.max_position_embeddings

    @property
    def num_layers(self) -> int:
        return self._config.num_hidden_layers

    @property
    def model_dim(self) -> int:
        return self._config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self._config.vocab_size

    @property
    def head_size(self) -> int:
        return getattr(self._config, "head_dim", None) or self.model_dim // self.n_heads

    @property
    def n_heads(self) -> int:
        return self._config.num_attention_heads

    @property
    def intermediate_dim(self) -> int:
        return self._config.intermediate_size

    @property
    def n_heads_kv(self) -> int:
        return self._config.num_key_value_heads

    @property
    def activation_dtype(self) -> DtypeEnum:
        return _activation_dtype(getattr(self._config, "torch_dtype", None))

    @property
    def mlp_activation_fn(self) -> ActivationType:
        activation = self._config.hidden_act.lower()
        if activation not in _ACTIVATIONS:
            raise NotImplementedError(f"Activation {activation} not supported")
        return _ACTIVATIONS[activation]

    @property
    def norm_type(self) -> NormTypeEnum:
        return NormTypeEnum.RMSNorm

    @property
    def positional_embedding_type(self) -> PositionalEmbeddingType:
        return PositionalEmbeddingType.rotate_half

    @property
    def positional_embedding_config(self) -> Optional[RotateHalfConfig]:
        return RotateHalfConfig(theta_base=getattr(self._config, "rope_theta", 1000000.0))

    def _forward_attention(self, layer_idx: int, qkv: torch.Tensor, kv_cache: torch.Tensor,
                           ragged_batch_info: object) -> torch.Tensor:
        return self.attn(qkv, kv_cache, ragged_batch_info)


def _get_rope_parameters(config: "PretrainedConfig") -> dict:
    """The RoPE parameters of the sliding-attention layers (``rope_parameters`` or the older ``rope_scaling``)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        raise ValueError("EXAONE 4.5 requires a RoPE parameter dictionary")
    sliding = rope.get("sliding_attention")
    return sliding if isinstance(sliding, dict) else rope


def _llama3_inverse_frequencies(config: "PretrainedConfig", device: Union[torch.device, int, str]) -> torch.Tensor:
    """Llama 3's scaled rotary inverse frequencies (float32): wavelengths longer than ``original_context /
    low_freq_factor`` are divided by ``factor``, shorter than ``original_context / high_freq_factor`` kept, and
    those between blended linearly in ``original_context / wavelength``."""
    rope = _get_rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"EXAONE 4.5 requires llama3 RoPE scaling, got {rope_type!r}")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    missing = [name for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if name not in rope] + (["rope_theta"] if theta is None else [])
    if missing:
        raise ValueError(f"EXAONE 4.5 is missing RoPE parameters: {', '.join(missing)}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"Rotary dimension must be a positive even number, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (float(theta)**exponents)
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original_context = float(rope["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original_context / low, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original_context / high) & (wavelength <= original_context / low)
    return torch.where(medium, smoothed, scaled)


def _supported_sequence_length(config: "PretrainedConfig") -> int:
    """The longest sequence served: the sliding window when any layer slides (DeepSpeed's dense blocked attention
    has no local mask, and within the window dense causal and sliding attention agree)."""
    longest = int(config.max_position_embeddings)
    if "sliding_attention" not in getattr(config, "layer_types", ()):
        return longest
    window = getattr(config, "sliding_window", None)
    if window is None:
        raise ValueError("EXAONE 4.5 sliding attention requires sliding_window")
    return min(longest, int(window))


class Exaone4_5InferenceModel(Exaone4InferenceModel):  # noqa: N801 - DeepSpeed's name
    """The text model of EXAONE 4.5: EXAONE 4.0's layout with hybrid attention, sliding layers using Llama-3 scaled
    RoPE (from trained frequencies) and full-attention layers no positional embedding, each kind its own attention
    module; sequences capped at the sliding window."""

    @property
    def max_sequence_length(self) -> int:
        return _supported_sequence_length(self._config)

    @property
    def positional_embedding_config(self) -> RotateHalfConfig:
        return RotateHalfConfig(use_trained_freqs=True)

    @property
    def activation_dtype(self) -> DtypeEnum:
        dtype = getattr(self._config, "torch_dtype", None)
        return _activation_dtype(getattr(self._config, "dtype", None) if dtype is None else dtype)

    def __init__(self, config: "PretrainedConfig", engine_config: RaggedInferenceEngineConfig,
                 base_mp_group: Optional["ProcessGroup"]) -> None:
        layer_types = tuple(getattr(config, "layer_types", ()))
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"Expected one EXAONE 4.5 layer type per layer, got {len(layer_types)} for "
                             f"{config.num_hidden_layers}")
        unsupported = set(layer_types) - {"sliding_attention", "full_attention"}
        if unsupported:
            raise ValueError(f"Unsupported EXAONE 4.5 layer types: {sorted(unsupported)}")
        super().__init__(config=config, engine_config=engine_config, base_mp_group=base_mp_group)
        self._layer_types = layer_types
        self._global_attn = self._build_global_attention()
        inv_freqs = _llama3_inverse_frequencies(config, get_accelerator().current_device())
        self.register_buffer("_rope_inv_freqs", inv_freqs.float(), persistent=False)

    def _build_global_attention(self) -> torch.nn.Module:
        manager = self._engine_config.state_manager
        return heuristics.instantiate_attention(DSSelfAttentionConfig(
            max_tokens=manager.max_ragged_batch_size, n_heads_q=self.n_heads_q_local, n_heads_kv=self.n_heads_kv_local,
            head_size=self.head_size, max_sequences=manager.max_ragged_sequence_count,
            scale_factor=1.0 / self.head_size**0.5, input_dtype=self.activation_dtype,
            output_dtype=self.activation_dtype, positional_embedding_type=PositionalEmbeddingType.none),
            self._engine_config)

    def prepare_batch(self, wrapped_batch: object) -> None:
        super().prepare_batch(wrapped_batch)
        self._global_attn.build_atoms(wrapped_batch)

    def get_kv_requirements(self, sequence: BaseSequenceDescriptor, max_new_tokens: int,
                            max_new_blocks: int) -> tuple[int, int]:
        remaining = max(self.max_sequence_length - sequence.seen_tokens, 0)
        return super().get_kv_requirements(sequence, min(max_new_tokens, remaining), max_new_blocks)

    def maybe_allocate_kv(self, sequence: BaseSequenceDescriptor, n_new_tokens: int) -> None:
        requested = sequence.seen_tokens + n_new_tokens
        if requested > self.max_sequence_length:
            raise ValueError(f"EXAONE 4.5 Inference V2 supports at most {self.max_sequence_length} tokens, got "
                             f"{requested}")
        super().maybe_allocate_kv(sequence, n_new_tokens)

    def _forward_attention(self, layer_idx: int, qkv: torch.Tensor, kv_cache: torch.Tensor,
                           ragged_batch_info: object) -> torch.Tensor:
        if self._layer_types[layer_idx] == "sliding_attention":
            return self.attn(qkv, kv_cache, ragged_batch_info, self._rope_inv_freqs)
        return self._global_attn(qkv, kv_cache, ragged_batch_info)


__all__ = ["Exaone4InferenceModel", "Exaone4_5InferenceModel"]
