"""Kernel injection (DeepSpeed's ``module_inject.replace_module``): each block a policy of
:data:`~.policies.replace_policies` names is replaced by an injected layer (:mod:`.layer`) holding its weights in
DeepSpeed's layout, this rank's share of them under tensor parallelism.

The weights are copied (Hugging Face's ``nn.Linear`` ``[out, in]`` transposed to the kernels' input-major
``[in, out]``) and cut as DeepSpeed cuts them: the query, key and value columns by heads (each rank keeps
``[q_r | k_r | v_r]``), the attention output and MLP output rows, the intermediate columns (a gated MLP's value and
gate halves each cut, then put side by side); norms and output biases are whole on every rank. The injected
layer's attention and MLP sum their outputs over the model-parallel group.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from dsrun import comm
from dsrun.inference.config import DeepSpeedInferenceConfig, merge_config
from dsrun.inference.groups import TPGroup, model_parallel_group
from dsrun.ops.transformer.inference.config import DeepSpeedInferenceConfig as KernelConfig
from dsrun.utils.errors import Problem, UserError
from dsrun.utils.types import GATED_ACTIVATION_TYPES

from .layer import DeepSpeedBERTInference, DeepSpeedGPTInference, DeepSpeedOPTInference, DeepSpeedTransformerInference
from .policies import (HFBertLayerPolicy, HFOPTLayerPolicy, HFRobertaLayerPolicy, TransformerPolicy,
                       replace_policies)

_LAYER_CLASS = {HFBertLayerPolicy: DeepSpeedBERTInference, HFRobertaLayerPolicy: DeepSpeedBERTInference,
                HFOPTLayerPolicy: DeepSpeedOPTInference}


def policy_for(module: nn.Module) -> type[TransformerPolicy] | None:
    """The policy whose block class ``module`` is (None: kernel injection leaves it as it is)."""
    for policy in replace_policies:
        cls = policy.orig_layer_class()
        if cls is not None and type(module) is cls:
            return policy
    return None


def _returns_tensor(block: nn.Module) -> bool:
    """Whether the block's forward returns the hidden states alone (transformers' current blocks) rather than a
    tuple: the injected layer answers in the same form."""
    annotation = inspect.signature(type(block).forward).return_annotation
    return annotation is torch.Tensor or annotation in ("torch.Tensor", "Tensor")


def _cache_index(block: nn.Module, position: int) -> int:
    for module in block.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            return index
    return position


def _cut(tensor: torch.Tensor | None, parts: list[int], tp: TPGroup, dim: int) -> torch.Tensor | None:
    """This rank's share of each of ``parts`` (sizes along ``dim``), side by side."""
    if tensor is None or tp.size == 1:
        return tensor
    pieces = tensor.split(parts, dim=dim)
    return torch.cat([piece.chunk(tp.size, dim=dim)[tp.rank] for piece in pieces], dim=dim)


def _input_major(weight: torch.Tensor | None, linear: bool) -> torch.Tensor | None:
    return None if weight is None else (weight.t() if linear else weight)


def _check_shape(policy: TransformerPolicy, hidden: int, heads: int, settings: dict[str, Any], tp: TPGroup) -> None:
    name = type(policy.client_module).__name__
    head_dim = settings.pop("head_dim", hidden // heads)
    rope_type = settings.pop("rope_type", "default")
    problems = []
    if head_dim * heads != hidden:
        problems.append(f"its heads are {head_dim} wide, not hidden_size / heads = {hidden // heads}")
    if rope_type != "default":
        problems.append(f"its rotary positions are scaled ({rope_type!r}); the kernel's are plain")
    kv = settings.get("num_kv", heads)
    if heads % tp.size or kv % tp.size:
        problems.append(f"its {heads} heads ({kv} key/value heads) do not split over {tp.size} ranks")
    if problems:
        raise UserError(Problem("init_inference.replace_with_kernel_inject", f"{name}: " + "; ".join(problems),
                                "leave replace_with_kernel_inject off (automatic tensor parallelism splits it)"))


def build_layer(policy: TransformerPolicy, config: DeepSpeedInferenceConfig, tp: TPGroup,
                returns_tensor: bool) -> DeepSpeedTransformerInference:
    """The injected layer for ``policy``'s block, its weights copied in (this rank's share)."""
    hidden, heads, eps, intermediate = policy.get_hidden_heads()
    settings = policy.layer_settings()
    _check_shape(policy, hidden, heads, settings, tp)
    dtype = config.dtype
    kernel_config = KernelConfig(
        hidden_size=hidden, intermediate_size=intermediate, heads=heads, layer_norm_eps=eps, mp_size=tp.size,
        dtype=dtype, pre_layer_norm=policy.pre_attn_norm, norm_type=policy.norm_type,
        scale_attention=policy.scale_attention, triangular_masking=config.triangular_masking,
        mlp_act_func_type=policy.mlp_act_func_type, use_mup=policy.use_mup, return_tuple=not returns_tensor,
        max_out_tokens=config.max_out_tokens, min_out_tokens=config.min_out_tokens)
    if "triangular_masking" in settings:  # an encoder's attention sees both ways whatever the engine's setting
        kernel_config.triangular_masking = settings.pop("triangular_masking")
    kernel_config.__dict__.update(settings)
    mp_group = None
    if tp.size > 1:  # TPGroup's None is the whole world; the layer's None is no group at all (DeepSpeed's)
        mp_group = tp.group if tp.group is not None else comm.get_world_group()
    layer = _LAYER_CLASS.get(type(policy), DeepSpeedGPTInference)(kernel_config, mp_group)
    linear = policy.linear_layer
    qkvw, qkvb, ow, ob = policy.attention()
    head_dim = hidden // heads
    kv = kernel_config.num_kv if kernel_config.num_kv > 0 else heads
    qkv_parts = [heads * head_dim, kv * head_dim, kv * head_dim]
    inter_w, inter_b, out_w, out_b = policy.mlp()
    gated = policy.mlp_act_func_type in GATED_ACTIVATION_TYPES
    inter_parts = [intermediate, intermediate] if gated else [intermediate]
    attn_nw, attn_nb, norm_w, norm_b = policy.layernorm()
    values = {
        (layer.attention, "attn_qkvw"): _cut(_input_major(qkvw, linear), qkv_parts, tp, dim=1),
        (layer.attention, "attn_qkvb"): _cut(qkvb, qkv_parts, tp, dim=0),
        (layer.attention, "attn_ow"): _cut(_input_major(ow, linear), [hidden], tp, dim=0),
        (layer.attention, "attn_ob"): ob,
        (layer.mlp, "inter_w"): _cut(_input_major(inter_w, linear), inter_parts, tp, dim=1),
        (layer.mlp, "inter_b"): _cut(inter_b, inter_parts, tp, dim=0),
        (layer.mlp, "output_w"): _cut(_input_major(out_w, linear), [intermediate], tp, dim=0),
        (layer.mlp, "output_b"): out_b,
        (layer.mlp, "attn_nw"): attn_nw, (layer.mlp, "attn_nb"): attn_nb,
        (layer, "norm_w"): norm_w, (layer, "norm_b"): norm_b}
    for (owner, name), value in values.items():
        if value is None:  # the block has no such tensor (no bias, no second norm): the kernels skip it
            setattr(owner, name, None)
            continue
        param = getattr(owner, name)
        if param.shape != value.shape:
            raise UserError(Problem(f"init_inference.replace_with_kernel_inject ({type(policy.client_module).__name__}"
                                    f".{name})", f"the block's tensor is {tuple(value.shape)}, the injected layer "
                                    f"expects {tuple(param.shape)}", "the model's config and weights disagree"))
        param.data = value.detach().to(device=param.device, dtype=param.dtype).contiguous().clone()
    return layer


def inject(model: nn.Module, config: DeepSpeedInferenceConfig, tp: TPGroup, only: type | None = None) -> int:
    """Replace every block of ``model`` a policy names (only those of class ``only`` when given) by an injected
    layer; the number replaced."""
    replaced = 0

    def walk(parent: nn.Module) -> None:
        nonlocal replaced
        for name, child in parent.named_children():
            policy = policy_for(child)
            if policy is not None and (only is None or type(child) is only):
                layer = build_layer(policy(child), config, tp, _returns_tensor(child))
                layer.cache_index = _cache_index(child, replaced)
                layer.attention.norm_factor = layer.attention.scale_for(layer.cache_index)
                signature = inspect.signature(type(child).forward)
                layer.client_signature = signature.replace(parameters=list(signature.parameters.values())[1:])
                setattr(parent, name, layer)
                replaced += 1
            else:
                walk(child)

    walk(model)
    return replaced


def replace_transformer_layer(orig_layer_impl: type | None, model: nn.Module, checkpoint_dict: object = None,
                              config: DeepSpeedInferenceConfig | None = None, model_config: object = None) -> nn.Module:
    """DeepSpeed's entry: inject the layers of ``model`` (those of class ``orig_layer_impl``, or every policy's
    when None) with ``config`` (``init_inference``'s settings); ``checkpoint_dict`` must be None (load the
    checkpoint into the model first: ``init_inference(checkpoint=...)`` does)."""
    if checkpoint_dict is not None:
        raise UserError(Problem("replace_transformer_layer(checkpoint_dict=...)", "loading a checkpoint during "
                                "injection is not implemented", "load it into the model, or pass checkpoint= to "
                                "init_inference"))
    config = config if config is not None else merge_config(None)
    tp = model_parallel_group(config.tp_size, config.tensor_parallel.tp_group,
                              config.tensor_parallel.mpu or config.mpu)
    inject(model, config, tp, only=orig_layer_impl)
    return model


__all__ = ["build_layer", "inject", "policy_for", "replace_transformer_layer"]
