"""DeepSpeed's kernel-injection policies (``deepspeed.module_inject.policy``, ``replace_policy`` and the
``containers``): for each Hugging Face block class kernel injection replaces, where its weights are.

A policy is built around one block (``client_module``) and answers DeepSpeed's four questions in the block's own
layouts: :meth:`~TransformerPolicy.get_hidden_heads` (hidden size, heads, norm epsilon, intermediate size),
:meth:`~TransformerPolicy.attention` (query/key/value weight and bias, output weight and bias),
:meth:`~TransformerPolicy.mlp` (intermediate and output weights and biases) and
:meth:`~TransformerPolicy.layernorm` (the norm before the MLP, then the block's input norm). ``linear_layer`` says
the weights are ``nn.Linear``'s ``[out, in]`` (transposed when injected) rather than GPT-2's ``Conv1D``
``[in, out]``. :meth:`~TransformerPolicy.layer_settings` (dsrun's) gives the family's settings of the injected
layer that DeepSpeed's containers set (rotary positions, local attention, the MLP beside the attention ...).
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from torch import nn

from dsrun.utils.types import ActivationFuncType, NormType

transformer_param_names = ("attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "inter_w", "inter_b", "output_w",
                           "output_b", "attn_nw", "attn_nb", "norm_w", "norm_b")

Tensor = Optional[torch.Tensor]


def _class(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _cat(*tensors: Tensor) -> Tensor:
    return None if any(t is None for t in tensors) else torch.cat(tensors, dim=0)  # type: ignore[arg-type]


def _bias(linear: nn.Module) -> Tensor:
    return getattr(linear, "bias", None)


class DSPolicy:
    """A policy's base: the block class it replaces, found when its library imports (``_orig_layer_class``)."""

    _orig_layer_class: Any = None
    _orig_layer_path: str = ""

    def __init__(self) -> None:
        self.cuda_graph_supported = False

    @classmethod
    def orig_layer_class(cls) -> type | None:
        if cls._orig_layer_class is None and cls._orig_layer_path:
            cls._orig_layer_class = _class(cls._orig_layer_path)
        return cls._orig_layer_class

    def attention(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        raise NotImplementedError


class TransformerPolicy(DSPolicy):
    """DeepSpeed's policy arguments (``linear_layer``, ``scale_attention``, ``mlp_act_func_type``,
    ``pre_attn_norm``, ``norm_type`` ...), kept as its attributes."""

    hf_model_config = None

    def __init__(self, inference: bool = True, linear_layer: bool = True, scale_attention: bool = True,
                 megatron_v2: bool = False, use_mup: bool = False,
                 mlp_act_func_type: ActivationFuncType = ActivationFuncType.GELU, pre_attn_norm: bool = True,
                 use_load_prefix: bool = False, split_qkv: bool = True, norm_type: NormType = NormType.LayerNorm):
        super().__init__()
        self.inference = inference
        self.linear_layer = linear_layer
        self.scale_attention = scale_attention
        self.is_megatron_v2 = megatron_v2
        self.use_mup = use_mup
        self.mlp_act_func_type = mlp_act_func_type
        self.pre_attn_norm = pre_attn_norm
        self.use_load_prefix = use_load_prefix
        self.split_qkv = split_qkv
        self.norm_type = norm_type

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        raise NotImplementedError

    def mlp(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def layernorm(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def layer_settings(self) -> dict[str, Any]:
        """The injected layer's settings this family needs beyond the defaults (DeepSpeed's container sets them)."""
        return {}


class HFGPT2LayerPolicy(TransformerPolicy):
    """GPT-2's ``GPT2Block`` (``Conv1D`` weights, Pre-LN, GELU)."""

    _orig_layer_path = "transformers.models.gpt2.modeling_gpt2.GPT2Block"

    def __init__(self, client_module: nn.Module, inference: bool = True):
        super().__init__(inference, linear_layer=False)
        self.client_module = client_module

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        attn = self.client_module.attn
        return attn.embed_dim, attn.num_heads, self.client_module.ln_1.eps, self.client_module.mlp.c_fc.nf

    def attention(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        attn = self.client_module.attn
        return attn.c_attn.weight, attn.c_attn.bias, attn.c_proj.weight, attn.c_proj.bias

    def mlp(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mlp = self.client_module.mlp
        return mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias

    def layernorm(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        block = self.client_module
        return block.ln_2.weight, block.ln_2.bias, block.ln_1.weight, block.ln_1.bias

    def layer_settings(self) -> dict[str, Any]:
        attn = self.client_module.attn
        return {"scale_attn_by_inverse_layer_idx": bool(getattr(attn, "scale_attn_by_inverse_layer_idx", False)),
                "scale_attention": bool(getattr(attn, "scale_attn_weights", True))}


class HFGPTNEOLayerPolicy(TransformerPolicy):
    """GPT-Neo's ``GPTNeoBlock`` (unscaled attention, global and local layers)."""

    _orig_layer_path = "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoBlock"

    def __init__(self, client_module: nn.Module, inference: bool = True):
        super().__init__(inference, scale_attention=False)
        self.client_module = client_module

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        attn = self.client_module.attn.attention
        return attn.embed_dim, attn.num_heads, self.client_module.ln_1.eps, self.client_module.mlp.c_fc.out_features

    def attention(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        attn = self.client_module.attn.attention
        return (_cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                _cat(_bias(attn.q_proj), _bias(attn.k_proj), _bias(attn.v_proj)), attn.out_proj.weight,
                attn.out_proj.bias)

    def mlp(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mlp = self.client_module.mlp
        return mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias

    def layernorm(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        block = self.client_module
        return block.ln_2.weight, block.ln_2.bias, block.ln_1.weight, block.ln_1.bias

    def layer_settings(self) -> dict[str, Any]:
        attn = self.client_module.attn
        local = attn.attention_type == "local"
        return {"local_attention": local,
                "window_size": int(getattr(attn.attention.config, "window_size", 256)) if local else 256}


class HFGPTJLayerPolicy(TransformerPolicy):
    """GPT-J's ``GPTJBlock`` (attention and MLP side by side on one norm, rotary "every two")."""

    _orig_layer_path = "transformers.models.gptj.modeling_gptj.GPTJBlock"

    def __init__(self, client_module: nn.Module, inference: bool = True):
        super().__init__(inference, scale_attention=True)
        self.client_module = client_module

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        attn = self.client_module.attn
        return attn.embed_dim, attn.num_attention_heads, self.client_module.ln_1.eps, \
            self.client_module.mlp.fc_in.out_features

    def attention(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        attn = self.client_module.attn
        return (_cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                _cat(_bias(attn.q_proj), _bias(attn.k_proj), _bias(attn.v_proj)), attn.out_proj.weight,
                _bias(attn.out_proj))

    def mlp(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mlp = self.client_module.mlp
        return mlp.fc_in.weight, mlp.fc_in.bias, mlp.fc_out.weight, mlp.fc_out.bias

    def layernorm(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return None, None, self.client_module.ln_1.weight, self.client_module.ln_1.bias

    def layer_settings(self) -> dict[str, Any]:
        attn = self.client_module.attn
        return {"mlp_after_attn": False, "rotary_dim": attn.rotary_dim or attn.head_dim, "rotate_every_two": True,
                "rotate_half": False}


class HFOPTLayerPolicy(TransformerPolicy):
    """OPT's ``OPTDecoderLayer`` (ReLU or GELU as the config says; Pre-LN or, ``do_layer_norm_before=False``,
    Post-LN)."""

    _orig_layer_path = "transformers.models.opt.modeling_opt.OPTDecoderLayer"

    def __init__(self, client_module: nn.Module, inference: bool = True, use_load_prefix: bool = True):
        super().__init__(inference, linear_layer=True, pre_attn_norm=client_module.do_layer_norm_before,
                         use_load_prefix=use_load_prefix)
        self.client_module = client_module
        act = getattr(client_module.self_attn.config, "activation_function", "relu")
        self.mlp_act_func_type = ActivationFuncType.GELU if "gelu" in act else ActivationFuncType.ReLU

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        attn = self.client_module.self_attn
        return attn.embed_dim, attn.num_heads, self.client_module.self_attn_layer_norm.eps, \
            self.client_module.fc1.out_features

    def attention(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        attn = self.client_module.self_attn
        return (_cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                _cat(_bias(attn.q_proj), _bias(attn.k_proj), _bias(attn.v_proj)), attn.out_proj.weight,
                _bias(attn.out_proj))

    def mlp(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        block = self.client_module
        return block.fc1.weight, _bias(block.fc1), block.fc2.weight, _bias(block.fc2)

    def layernorm(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        block = self.client_module
        first, second = block.self_attn_layer_norm, block.final_layer_norm
        if not self.pre_attn_norm:  # Post-LN: the attention's norm comes before the MLP, the final one last
            first, second = second, first
        return second.weight, second.bias, first.weight, first.bias


class HFBertLayerPolicy(TransformerPolicy):
    """BERT's and RoBERTa's ``BertLayer``/``RobertaLayer`` (Post-LN, both directions)."""

    _orig_layer_path = "transformers.models.bert.modeling_bert.BertLayer"

    def __init__(self, client_module: nn.Module, inference: bool = False):
        super().__init__(inference, pre_attn_norm=False)
        self.client_module = client_module

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        attn = self.client_module.attention
        return attn.self.query.weight.shape[1], attn.self.num_attention_heads, attn.output.LayerNorm.eps, \
            self.client_module.intermediate.dense.out_features

    def attention(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        attn = self.client_module.attention
        qkv = attn.self.query, attn.self.key, attn.self.value
        return (_cat(*(m.weight for m in qkv)), _cat(*(_bias(m) for m in qkv)), attn.output.dense.weight,
                attn.output.dense.bias)

    def mlp(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        block = self.client_module
        return block.intermediate.dense.weight, block.intermediate.dense.bias, block.output.dense.weight, \
            block.output.dense.bias

    def layernorm(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        block = self.client_module
        attn_norm, out_norm = block.attention.output.LayerNorm, block.output.LayerNorm
        return attn_norm.weight, attn_norm.bias, out_norm.weight, out_norm.bias

    def layer_settings(self) -> dict[str, Any]:
        return {"triangular_masking": False}


class HFRobertaLayerPolicy(HFBertLayerPolicy):
    _orig_layer_path = "transformers.models.roberta.modeling_roberta.RobertaLayer"


class LLAMALayerPolicy(TransformerPolicy):
    """Llama's ``LlamaDecoderLayer`` (RMSNorm, SwiGLU, rotary "rotate half", grouped-query attention)."""

    _orig_layer_path = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"

    def __init__(self, client_module: nn.Module, inference: bool = True):
        super().__init__(inference, mlp_act_func_type=ActivationFuncType.GATED_SILU, norm_type=NormType.RMSNorm)
        self.client_module = client_module

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        config = self.client_module.self_attn.config
        return config.hidden_size, config.num_attention_heads, self.client_module.input_layernorm.variance_epsilon, \
            self.client_module.mlp.gate_proj.out_features

    def attention(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        attn = self.client_module.self_attn
        return (_cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                _cat(_bias(attn.q_proj), _bias(attn.k_proj), _bias(attn.v_proj)), attn.o_proj.weight,
                _bias(attn.o_proj))

    def mlp(self, enable_training: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mlp = self.client_module.mlp
        return (_cat(mlp.up_proj.weight, mlp.gate_proj.weight), _cat(_bias(mlp.up_proj), _bias(mlp.gate_proj)),
                mlp.down_proj.weight, _bias(mlp.down_proj))

    def layernorm(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        block = self.client_module
        return block.post_attention_layernorm.weight, None, block.input_layernorm.weight, None

    def layer_settings(self) -> dict[str, Any]:
        config = self.client_module.self_attn.config
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return {"rotary_dim": config.hidden_size // config.num_attention_heads, "rotate_half": True,
                "rotate_every_two": False, "rope_theta": float(theta),
                "num_kv": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                "rope_type": rope.get("rope_type", "default"), "head_dim": self.client_module.self_attn.head_dim}


#: DeepSpeed's ``replace_policies``: the policies kernel injection tries, in order
replace_policies = [HFBertLayerPolicy, HFRobertaLayerPolicy, HFGPTNEOLayerPolicy, HFGPTJLayerPolicy,
                    HFGPT2LayerPolicy, HFOPTLayerPolicy, LLAMALayerPolicy]

__all__ = ["DSPolicy", "HFBertLayerPolicy", "HFGPT2LayerPolicy", "HFGPTJLayerPolicy", "HFGPTNEOLayerPolicy",
           "HFOPTLayerPolicy", "HFRobertaLayerPolicy", "LLAMALayerPolicy", "TransformerPolicy", "replace_policies",
           "transformer_param_names"]
