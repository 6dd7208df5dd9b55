"""DeepSpeed's v1 inference kernels (the ``transformer_inference`` and ``spatial_inference`` ops) in torch.

DeepSpeed compiles these as CUDA kernels; here each is the kernel's math in torch, so they run on any device
and there is nothing to build. ``InferenceBuilder().load()`` and ``SpatialInferenceBuilder().load()``
(``op_builder``) return them under the extension's names (:func:`inference_module`, :func:`spatial_module`:
``bias_add_fp16`` ... one per dtype, as DeepSpeed's binding defines them). What the kernels promise, kept here:

* element-wise ops on half inputs compute in float32 and round once to the input's dtype;
* the norms accumulate mean and variance in float32 and return ``gamma``'s dtype;
* ``residual_add_bias`` writes its result into ``residual`` (in place) and returns it;
* the NHWC bias adds keep the activation's memory format (``torch.channels_last`` in, channels-last out);
* ``dequantize_*`` multiplies each row-major group of an INT8 weight by its scale.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from dsrun.utils.types import ActivationFuncType

_F32 = torch.float32


def bias_add(activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``activations + bias`` (bias broadcast over the last dimension), in the activations' dtype."""
    return torch.add(activations, bias)


def bias_gelu(activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation, as DeepSpeed's kernel) of ``activations + bias``, computed in float32."""
    return F.gelu(activations.to(_F32) + bias.to(_F32), approximate="tanh").to(activations.dtype)


def bias_relu(activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """ReLU of ``activations + bias``, computed in float32."""
    return F.relu(activations.to(_F32) + bias.to(_F32)).to(activations.dtype)


def gated_activation(activation: torch.Tensor, bias: torch.Tensor,
                     activation_func_type: ActivationFuncType) -> torch.Tensor:
    """``value * act(gate)`` where ``activation + bias`` is ``[value | gate]`` along the last dimension (half the
    width out); ``act`` is GELU (exact) for ``GATED_GELU``, SiLU for ``GATED_SILU``; computed in float32."""
    acts = {ActivationFuncType.GATED_GELU: F.gelu, ActivationFuncType.GATED_SILU: F.silu}
    if activation_func_type not in acts:
        raise ValueError(f"gated_activation: activation_func_type {activation_func_type!r} is not gated; expected "
                         "ActivationFuncType.GATED_GELU or GATED_SILU")
    value, gate = (activation.to(_F32) + bias.to(_F32)).chunk(2, dim=-1)
    return (value * acts[activation_func_type](gate)).to(activation.dtype)


def layer_norm(vals: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LayerNorm over the last dimension in float32, returned in ``gamma``'s dtype."""
    return F.layer_norm(vals.to(_F32), gamma.shape, gamma.to(_F32), beta.to(_F32), epsilon).to(gamma.dtype)


def layer_norm_residual(vals: torch.Tensor, bias: torch.Tensor, res: torch.Tensor, gamma: torch.Tensor,
                        beta: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LayerNorm of ``vals + bias + res`` (summed in float32), in ``gamma``'s dtype."""
    return layer_norm_residual_store_pre_ln_res(vals, bias, res, gamma, beta, epsilon)[0]


def layer_norm_residual_store_pre_ln_res(vals: torch.Tensor, bias: torch.Tensor, res: torch.Tensor,
                                         gamma: torch.Tensor, beta: torch.Tensor,
                                         epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LayerNorm(vals + bias + res), vals + bias + res)``, both in ``gamma``'s dtype (the sum is the next
    residual, which DeepSpeed's kernel stores on the way)."""
    summed = vals.to(_F32) + bias.to(_F32) + res.to(_F32)
    normed = F.layer_norm(summed, gamma.shape, gamma.to(_F32), beta.to(_F32), epsilon)
    return normed.to(gamma.dtype), summed.to(gamma.dtype)


def rms_norm(vals: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``gamma * vals / sqrt(mean(vals²) + epsilon)`` over the last dimension, the mean in float32; the normalised
    values are rounded to ``gamma``'s dtype before the scale when it is a half type."""
    normed = vals.to(_F32) * torch.rsqrt(vals.to(_F32).pow(2).mean(-1, keepdim=True) + epsilon)
    if gamma.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(gamma.dtype)
    return gamma * normed


def pre_rms_norm(vals: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                 epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(vals + residual), vals + residual)``: the sum in float32, returned in ``gamma``'s dtype."""
    summed = vals.to(_F32) + residual.to(_F32)
    return rms_norm(summed, gamma, epsilon), summed.to(gamma.dtype)


def moe_res_matmul(residual: torch.Tensor, coef: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """PR-MoE's residual mix ``residual * c1 + output * c2``, ``coef`` holding ``[c1 | c2]`` along its middle
    dimension (``[batch, 2 * hidden, 1]``, the kernel's layout)."""
    c1, c2 = coef.transpose(1, 2).chunk(2, dim=-1)
    return residual * c1 + output * c2


def vector_add(a: torch.Tensor, b: torch.Tensor, gamma: float) -> torch.Tensor:
    """``gamma * a + b`` in float32, in ``a``'s dtype (DeepSpeed's ``_vector_add``)."""
    return (gamma * a.to(_F32) + b.to(_F32)).to(a.dtype)


def residual_add_bias(hidden_state: torch.Tensor, residual: torch.Tensor, attention_output: torch.Tensor,
                      attention_bias: torch.Tensor, final_bias: torch.Tensor, mp_size: int, mlp_after_attn: bool,
                      add_bias: bool, pre_layer_norm: bool) -> torch.Tensor:
    """The residual of a transformer block, summed in float32 and written into ``residual`` (returned):

    * MLP after attention, Pre-LN: ``hidden + (residual + attention_output + attention_bias + final_bias) / mp_size``
      (each tensor-parallel rank adds its share before the all-reduce);
    * MLP after attention, Post-LN: ``residual + hidden + final_bias``;
    * attention and MLP in parallel (GPT-J): ``hidden + attention_output + (residual + final_bias) / mp_size``,
      plus ``attention_bias / mp_size`` when ``add_bias``.
    """
    hidden, res, final = hidden_state.to(_F32), residual.to(_F32), final_bias.to(_F32)
    if mlp_after_attn and pre_layer_norm:
        out = hidden + (res + attention_output.to(_F32) + attention_bias.to(_F32) + final) / mp_size
    elif mlp_after_attn:
        out = res + hidden + final
    else:
        out = hidden + attention_output.to(_F32) + (res + final) / mp_size
        if add_bias:
            out = out + attention_bias.to(_F32) / mp_size
    residual.copy_(out.to(residual.dtype))
    return residual


def dequantize(weight: torch.Tensor, scale: torch.Tensor, groups: int, dtype: torch.dtype = _F32) -> torch.Tensor:
    """An INT8 ``weight`` split into ``groups`` equal row-major groups, each times its ``scale`` (``[groups, 1]``),
    in ``dtype`` (DeepSpeed's ``dequantize_fp16``/``_bf16``/``_fp32``, the weights of its INT8 inference)."""
    return (weight.reshape(groups, -1).to(_F32) * scale.to(_F32)).reshape(weight.shape).to(dtype)


def _nhwc(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    fmt = torch.channels_last if like.dim() == 4 and like.is_contiguous(memory_format=torch.channels_last) \
        else torch.contiguous_format
    return result.contiguous(memory_format=fmt)


def nhwc_bias_add(activation: torch.Tensor, bias: torch.Tensor, other: torch.Tensor | None = None,
                  other_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``activation + bias`` with ``bias`` per channel of an NCHW-shaped tensor (``[C]`` over dimension 1), plus
    ``other`` (and ``other_bias``, per channel) when given; in the activation's dtype and memory format."""
    out = activation + bias.reshape(1, -1, 1, 1)
    if other is not None:
        out = out + (other if other_bias is None else other + other_bias.reshape(1, -1, 1, 1))
    return _nhwc(out, activation)


_SUFFIXES = ("fp32", "fp16", "bf16")
_PER_DTYPE = {"bias_add": bias_add, "bias_gelu": bias_gelu, "bias_relu": bias_relu,
              "residual_add_bias": residual_add_bias}
_ONCE = {"layer_norm": layer_norm, "_layer_norm_residual": layer_norm_residual,
         "layer_norm_residual_store_pre_ln_res": layer_norm_residual_store_pre_ln_res, "rms_norm": rms_norm,
         "pre_rms_norm": pre_rms_norm, "gated_activation": gated_activation, "moe_res_matmul": moe_res_matmul,
         "_vector_add": vector_add}


def inference_module() -> ModuleType:
    """The ``transformer_inference`` op as ``InferenceBuilder().load()`` returns it: the functions above under the
    names of DeepSpeed's binding (``bias_add_fp16``/``_bf16``/``_fp32`` ..., ``layer_norm``, ``rms_norm``)."""
    module = ModuleType("deepspeed.ops.transformer_inference_op", __doc__)
    for name, fn in _PER_DTYPE.items():
        for suffix in _SUFFIXES:
            setattr(module, f"{name}_{suffix}", fn)
    for name, fn in _ONCE.items():
        setattr(module, name, fn)
    for suffix, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        setattr(module, f"dequantize_{suffix}", functools.partial(dequantize, dtype=dtype))
    return module


def spatial_module() -> ModuleType:
    """The ``spatial_inference`` op as ``SpatialInferenceBuilder().load()`` returns it."""
    module = ModuleType("deepspeed.ops.spatial_inference_op", __doc__)
    module.nhwc_bias_add = lambda activation, bias: nhwc_bias_add(activation, bias)
    module.nhwc_bias_add_add = lambda activation, bias, other: nhwc_bias_add(activation, bias, other)
    module.nhwc_bias_add_bias_add = nhwc_bias_add
    return module
