"""DeepSpeed's ``DeepSpeedInferenceConfig`` of the v1 inference kernels (``deepspeed.ops.transformer``): the
settings an op of :mod:`.op_binding` reads (``dtype`` picks the kernel, ``mp_size``, ``pre_layer_norm`` and
``mlp_after_attn`` shape the residual add, ``epsilon`` the norms), with DeepSpeed's arguments and defaults.

Not the settings of ``init_inference`` (that is :class:`dsrun.inference.config.DeepSpeedInferenceConfig`, DeepSpeed's
``deepspeed.inference.config``): DeepSpeed has two classes of this name, and so does dsrun.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from dsrun.utils.types import ActivationFuncType, NormType


class TransformerConfig:
    """The shape of a layer (DeepSpeed's base class of the kernel config)."""

    def __init__(self, hidden_size: int, intermediate_size: int, heads: int, num_hidden_layers: int):
        self.layer_id = -1
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.num_hidden_layers = num_hidden_layers


class DeepSpeedInferenceConfig(TransformerConfig):
    """A v1 inference layer's settings; ``intermediate_size`` defaults to ``4 * hidden_size``, ``layer_norm_eps`` is
    kept as ``epsilon``. Every argument is kept as an attribute of its own name."""

    def __init__(self, hidden_size: int = -1, intermediate_size: int = -1, heads: int = -1,
                 num_hidden_layers: int = -1, layer_norm_eps: float = 1e-12, local_rank: int = -1, mp_size: int = 1,
                 dtype: torch.dtype = torch.float16, pre_layer_norm: bool = True,
                 norm_type: NormType = NormType.LayerNorm, stochastic_mode: bool = False,
                 scale_attention: bool = True, triangular_masking: bool = True, local_attention: bool = False,
                 window_size: int = 256, rotary_dim: int = -1, rotate_half: bool = False,
                 rotate_every_two: bool = True, return_tuple: bool = True, mlp_after_attn: bool = True,
                 mlp_act_func_type: ActivationFuncType = ActivationFuncType.GELU, training_mp_size: int = 1,
                 bigscience_bloom: bool = False, max_out_tokens: int = 1024, min_out_tokens: int = 1,
                 enable_qkv_quantization: bool = False, use_mup: bool = False,
                 scale_attn_by_inverse_layer_idx: bool = False, return_single_tuple: bool = False,
                 set_empty_params: bool = False, transposed_mode: bool = False, use_triton: bool = False,
                 triton_autotune: bool = False, num_kv: int = -1, rope_theta: float = 10000,
                 invert_mask: bool = True):
        super().__init__(hidden_size, intermediate_size if intermediate_size > 0 else 4 * hidden_size, heads,
                         num_hidden_layers)
        settings = dict(locals())
        for name in ("self", "__class__", "hidden_size", "intermediate_size", "heads", "num_hidden_layers",
                     "layer_norm_eps"):
            settings.pop(name)
        self.__dict__.update(settings)
        self.epsilon = layer_norm_eps

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> "DeepSpeedInferenceConfig":
        """The defaults with each key of ``json_object`` set as an attribute (DeepSpeed's ``from_dict``)."""
        config = cls()
        config.__dict__.update(json_object)
        return config

    @classmethod
    def from_json_file(cls, json_file: str) -> "DeepSpeedInferenceConfig":
        with open(json_file, encoding="utf-8") as reader:
            return cls.from_dict(json.load(reader))
