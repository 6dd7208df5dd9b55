"""DeepSpeed's v1 injected transformer layer (``deepspeed.model_implementations``): the block kernel injection puts
in place of a model's own (:func:`~.replace.replace_transformer_layer`).

:class:`DeepSpeedTransformerInference` is an attention (:class:`~dsrun.ops.transformer.inference.ds_attention.
DeepSpeedSelfAttention`) and an MLP (:class:`~dsrun.ops.transformer.inference.ds_mlp.DeepSpeedMLP`) over
DeepSpeed's parameter layout, with the input norm ``norm_w``/``norm_b`` (Pre-LN; the final norm with Post-LN). It
takes the arguments of every block it stands in for (``hidden_states``, ``attention_mask``, ``layer_past``,
``past_key_value``, Hugging Face's ``cache`` and ``position_ids`` ...). Between calls it keeps the last keys and
values (``layer_past``) when no cache is passed, as DeepSpeed's layer does; given a Hugging Face ``Cache`` it updates
that instead, so the model's own generation loop sees the tokens it holds. It returns what the block it replaced
returned (a tensor for transformers' current blocks, a tuple for tuple-returning ones, as ``return_tuple`` says).
"""
from __future__ import annotations

import inspect
import weakref
from typing import Union

import torch
from torch import nn
from torch.distributed import ProcessGroup

from dsrun.ops.transformer.inference import kernels
from dsrun.ops.transformer.inference.config import DeepSpeedInferenceConfig
from dsrun.ops.transformer.inference.op_binding import LayerNormOp
from dsrun.utils.errors import Problem, UserError
from dsrun.utils.logging import log_dist
from dsrun.utils.types import NormType

from .attention import DeepSpeedSelfAttention, Mask, Past
from .mlp import DeepSpeedMLP

Tensor = Union[torch.Tensor, None]
#: what the layer returns: the hidden states, with the keys and values or the mask when asked
Output = Union[torch.Tensor, tuple[object, ...]]

_LIVE: "weakref.WeakSet[DeepSpeedTransformerInference]" = weakref.WeakSet()


class DeepSpeedTransformerInference(nn.Module):
    """One injected transformer block (DeepSpeed's arguments: ``config`` is the kernels'
    :class:`~dsrun.ops.transformer.inference.config.DeepSpeedInferenceConfig`, ``mp_group`` the model-parallel
    group the attention and MLP outputs are summed over; the quantization arguments are kept as DeepSpeed keeps
    them)."""

    layer_id = 0

    def __init__(self, config: DeepSpeedInferenceConfig, mp_group: ProcessGroup | None = None,
                 quantize_scales: torch.Tensor | None = None, quantize_groups: int = 1, merge_count: int = 1,
                 mlp_extra_grouping: bool = False):
        super().__init__()
        if config.bigscience_bloom:
            raise UserError(Problem("DeepSpeedInferenceConfig.bigscience_bloom", "BLOOM's ALiBi attention layer is "
                                    "not provided by dsrun's injected layer", "inject without it (automatic tensor "
                                    "parallelism splits BLOOM)"))
        if config.use_triton:
            raise UserError(Problem("DeepSpeedInferenceConfig.use_triton", "dsrun has no Triton kernels",
                                    "leave use_triton false: the torch kernels run everywhere"))
        self.config = config
        self.config.layer_id = DeepSpeedTransformerInference.layer_id
        DeepSpeedTransformerInference.layer_id += 1
        if DeepSpeedTransformerInference.layer_id == 1:
            log_dist(f"DeepSpeed-Inference config: {self.config.__dict__}", [0])
        self.attention = DeepSpeedSelfAttention(config, mp_group, quantize_scales, quantize_groups, merge_count)
        self.mlp = DeepSpeedMLP(config, mp_group, quantize_scales, quantize_groups, merge_count, mlp_extra_grouping)
        dtype = torch.half if config.dtype == torch.int8 else config.dtype
        if config.set_empty_params:
            self.norm_w = self.norm_b = None
        else:
            self.norm_w = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
            self.norm_b = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
        self.layer_past: Past = None
        self.layer_norm = LayerNormOp()
        self.cache_index = 0  # the block's place in its model, for a Hugging Face Cache (set by the injection)
        self.client_signature: inspect.Signature | None = None  # the replaced block's forward (set by the injection)
        _LIVE.add(self)

    @classmethod
    def reset_cache(cls) -> None:
        """Forget the keys and values every live injected layer keeps between calls (DeepSpeed's workspace
        reset)."""
        for layer in list(_LIVE):
            layer.layer_past = None

    def forward(self, *args: object, **kwargs: object) -> Output:
        """DeepSpeed's arguments (:meth:`ds_forward`); positional arguments past the first mean what they meant to
        the block this layer replaced (``client_signature``: Hugging Face's GPT-2 passes its cache second)."""
        if len(args) > 1 and self.client_signature is not None:
            bound = self.client_signature.bind_partial(*args, **kwargs).arguments
            for name, param in self.client_signature.parameters.items():
                if param.kind == inspect.Parameter.VAR_KEYWORD and name in bound:
                    bound.update(bound.pop(name))
            return self.ds_forward(**bound)
        return self.ds_forward(*args, **kwargs)

    def ds_forward(self, input: torch.Tensor | tuple[torch.Tensor, Mask] | None = None, input_mask: Mask = None,
                   attention_mask: Mask = None, attn_mask: Mask = None, head_mask: Tensor = None,
                   layer_past: Past = None, get_key_value: bool = False, get_present: bool = False,
                   encoder_output: Tensor = None, enc_dec_attn_mask: Mask = None, x: Tensor = None,
                   encoder_hidden_states: Tensor = None, encoder_attention_mask: Mask = None,
                   use_cache: bool | None = False, alibi: Tensor = None, output_attentions: bool | None = False,
                   layer_head_mask: Tensor = None, past_key_value: Past = None, **kwargs: object) -> Output:
        """DeepSpeed's layer forward: ``input`` (or ``x``, ``hidden_states``) the hidden states, the mask under any
        of its names, the earlier keys and values as ``layer_past``/``past_key_value`` or a Hugging Face
        ``cache``/``past_key_values``; ``position_ids`` place rotary positions."""
        if x is not None:
            input = x
        input = kwargs.pop("hidden_states", input)
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if layer_past is not None and past_key_value is not None:
            raise ValueError("Only one of `layer_past` or `past_key_value` can be present.")
        if attention_mask is None:
            attention_mask = input_mask if attn_mask is None else attn_mask
        mask_from_input = None
        if isinstance(input, tuple):  # DeepSpeed's (hidden states, mask) pair
            input, mask_from_input = input
        get_present = get_present or get_key_value or bool(use_cache)
        if input.shape[1] > 1:  # a prompt: the kept keys and values of an earlier call are stale
            self.layer_past = None
        past = layer_past if layer_past is not None else past_key_value
        if past is None:
            past = cache if cache is not None else self.layer_past
        head_mask = layer_head_mask if layer_head_mask is not None else head_mask
        for name, value in (("head_mask", head_mask), ("encoder_hidden_states", encoder_hidden_states),
                            ("encoder_output", encoder_output), ("output_attentions", output_attentions or None)):
            if value is not None:  # DeepSpeed's kernels take them and ignore them; dsrun says so
                raise UserError(Problem(f"{type(self).__name__}({name}=...)", "the injected layer has no head mask, "
                                        "cross-attention or attention-weights output", "call the model without it, "
                                        "or without replace_with_kernel_inject"))
        input_type = input.dtype
        if self.config.dtype in (torch.float16, torch.bfloat16, torch.int8) and input.dtype == torch.float:
            input = input.to(torch.half if self.config.dtype == torch.int8 else self.config.dtype)
        with torch.no_grad():
            attention_output, key, value, _, inp_norm = self.attention(
                input, attention_mask, head_mask, past, get_present, encoder_hidden_states, encoder_attention_mask,
                output_attentions, self.norm_w, self.norm_b, alibi, cache_index=self.cache_index,
                position_ids=kwargs.get("position_ids"))
            presents = (key, value)
            if cache is None and layer_past is None and past_key_value is None:
                self.layer_past = presents
            output = self.mlp(attention_output, input, inp_norm, self.attention.attn_ob)
            if not self.config.pre_layer_norm:
                if self.config.norm_type == NormType.RMSNorm:
                    output = kernels.rms_norm(output, self.norm_w, self.config.epsilon)
                else:
                    output = self.layer_norm(output, self.norm_w, self.norm_b, self.config.epsilon)
            output = output.to(input_type)
        if get_present and cache is None:
            output = (output, presents)
        if self.config.return_single_tuple:
            return (output,)
        if self.config.return_tuple:
            return output if isinstance(output, tuple) else (output, mask_from_input)
        return output


class DeepSpeedGPTInference(DeepSpeedTransformerInference):
    """The injected layer of the GPT families (GPT-2, GPT-Neo, GPT-J, GPT-NeoX, Llama)."""


class DeepSpeedBERTInference(DeepSpeedTransformerInference):
    """The injected layer of BERT-style encoders."""


class DeepSpeedOPTInference(DeepSpeedTransformerInference):
    """The injected layer of OPT."""


class DeepSpeedMegatronGPTInference(DeepSpeedTransformerInference):
    """The injected layer of Megatron's GPT."""


class DeepSpeedLlama2Inference(DeepSpeedTransformerInference):
    """The injected layer of Meta's own Llama 2 code (``llama.model.TransformerBlock``): always keeps its keys and
    values (DeepSpeed's ``get_present``) and returns the hidden states alone."""

    def forward(self, *args: object, **kwargs: object) -> Output:
        kwargs.setdefault("use_cache", True)
        out = super().forward(*args[:1], **kwargs)
        return out[0] if isinstance(out, tuple) else out


__all__ = ["DeepSpeedBERTInference", "DeepSpeedGPTInference", "DeepSpeedLlama2Inference",
           "DeepSpeedMegatronGPTInference", "DeepSpeedOPTInference", "DeepSpeedTransformerInference"]
