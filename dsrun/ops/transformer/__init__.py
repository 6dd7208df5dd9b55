"""DeepSpeed's transformer kernel API in plain torch: :class:`DeepSpeedTransformerConfig` and
:class:`DeepSpeedTransformerLayer` (a BERT layer with DeepSpeed's parameter names, Pre-/Post-LN, and the
memory flags ``normalize_invertible``, ``attn_dropout_checkpoint``, ``gelu_checkpoint``). CPU and CUDA.
Details and measurements: docs/transformer_kernel.md. ``DeepSpeedInferenceConfig`` is the v1 inference kernels'
config (:mod:`dsrun.ops.transformer.inference`)."""
from dsrun.ops.transformer.config import DeepSpeedTransformerConfig, TransformerConfig
from dsrun.ops.transformer.inference.config import DeepSpeedInferenceConfig
from dsrun.ops.transformer.layer import DeepSpeedTransformerLayer

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "TransformerConfig"]
