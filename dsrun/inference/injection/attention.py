"""DeepSpeed's v1 inference self-attention (``deepspeed.ops.transformer.inference.ds_attention``) in torch.

:class:`DeepSpeedSelfAttention` holds a layer's fused query/key/value weight ``attn_qkvw`` (``[hidden, q + k + v]``,
input-major as DeepSpeed keeps it, this rank's heads only under tensor parallelism), its bias ``attn_qkvb`` and the
output projection ``attn_ow`` (``[hidden / mp, hidden]``); the output bias ``attn_ob`` is added later, in the
block's residual add (``ResidualAddOp``), as DeepSpeed's kernels do. The forward is the math of DeepSpeed's
``qkv_gemm`` (the input's norm fused in with Pre-LN), ``softmax_context`` (rotary positions, the KV cache, the
causal and the local-window masks, softmax in float32) and ``vector_matmul`` kernels, on the torch kernels of
:mod:`dsrun.ops.transformer.inference`. Served as DeepSpeed's ``ops.transformer.inference.ds_attention``.
"""
from __future__ import annotations

import math
from typing import Optional, Protocol, Union

import torch
from torch import nn
from torch.distributed import ProcessGroup

from dsrun import comm as dist
from dsrun.accelerator import get_accelerator
from dsrun.ops.transformer.inference import kernels
from dsrun.ops.transformer.inference.config import DeepSpeedInferenceConfig
from dsrun.utils.types import NormType

minus_inf = -10000.0


class KVCache(Protocol):
    """What the attention asks of a Hugging Face ``Cache``."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


#: a layer's earlier keys and values: DeepSpeed's ``(key, value)`` pair, a Hugging Face ``Cache``, or none
Past = Optional[Union[tuple[torch.Tensor, torch.Tensor], KVCache]]
Mask = Union[torch.Tensor, bool, None]


def rotate(x: torch.Tensor, rotary_dim: int, positions: torch.Tensor, theta: float, half: bool) -> torch.Tensor:
    """Rotary position embedding of the first ``rotary_dim`` channels of each head (``x``: ``[b, heads, s, d]``,
    ``positions``: ``[b, s]``), computed in float32: "rotate half" (GPT-NeoX, Llama) or "every two" (GPT-J)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=x.device) / rotary_dim))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [b, 1, s, rotary_dim / 2]
    rot, rest = x[..., :rotary_dim].to(torch.float32), x[..., rotary_dim:]
    if half:
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        first, second = rot.chunk(2, dim=-1)
        turned = torch.cat([-second, first], dim=-1)
    else:
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        turned = torch.stack([-rot[..., 1::2], rot[..., ::2]], dim=-1).flatten(-2)
    return torch.cat([(rot * cos + turned * sin).to(x.dtype), rest], dim=-1)


def keep_mask(mask: Mask, batch: int, queries: int, keys: int) -> torch.Tensor | None:
    """A caller's attention mask as booleans ``[b, 1|heads, q, k]`` (True: attend), or None. Accepted: Hugging
    Face's 4-D boolean (True attends) or additive float masks, and DeepSpeed's 2-D ``[b, k]`` int64 masks (1
    attends; a float 2-D mask is additive, as DeepSpeed adds it)."""
    if mask is None or mask is False or not torch.is_tensor(mask):
        return None
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
        if mask.dtype in (torch.int64, torch.int32, torch.bool):
            return mask.bool()[..., -keys:]
    elif mask.dim() == 3:
        mask = mask[:, None]
    if mask.dtype == torch.bool:
        return mask[..., -queries:, -keys:]
    return (mask > minus_inf / 2)[..., -queries:, -keys:]


class DeepSpeedSelfAttention(nn.Module):
    """A v1 inference layer's attention (DeepSpeed's arguments; ``q_scales``/``q_groups``/``merge_count`` are
    kept as DeepSpeed keeps them for its INT8 path)."""

    num_layers = 0

    def __init__(self, config: DeepSpeedInferenceConfig, mp_group: ProcessGroup | None = None,
                 q_scales: torch.Tensor | None = None, q_groups: int = 1, merge_count: int = 1):
        super().__init__()
        self.config = config
        self.config.layer_id = DeepSpeedSelfAttention.num_layers
        DeepSpeedSelfAttention.num_layers += 1
        dtype = config.dtype
        dtype_fp = torch.half if dtype == torch.int8 else dtype
        device = get_accelerator().current_device_name()
        head_dim = config.hidden_size // config.heads
        kv_heads = config.heads if config.num_kv < 0 else config.num_kv
        self.num_attention_heads_per_partition = config.heads // config.mp_size
        self.num_kv_partition = kv_heads // config.mp_size
        self.hidden_size_per_partition = config.hidden_size // config.mp_size
        self.hidden_size_per_attention_head = head_dim
        qkv_size = (self.num_attention_heads_per_partition + 2 * self.num_kv_partition) * head_dim
        if config.set_empty_params:
            self.attn_qkvw = self.attn_qkvb = self.attn_ow = self.attn_ob = None
        else:
            def empty(*shape: int, dt: torch.dtype = dtype_fp) -> nn.Parameter:
                return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

            self.attn_qkvw = empty(config.hidden_size, qkv_size, dt=dtype)
            self.attn_qkvb = empty(qkv_size)
            self.attn_ow = empty(self.hidden_size_per_partition, config.hidden_size, dt=dtype)
            self.attn_ob = empty(config.hidden_size)
        self.mp_group = mp_group
        self.q_scales, self.q_groups, self.merge_count = q_scales, q_groups, int(math.log2(merge_count))
        self.norm_factor = self.scale_for(config.layer_id)

    def scale_for(self, layer_id: int) -> float:
        """DeepSpeed scales query and key each by 1 / norm_factor: sqrt(sqrt(head_dim)), or sqrt(head_dim) with muP;
        with ``scale_attn_by_inverse_layer_idx`` (GPT-2) also by 1 / sqrt(layer_id + 1). DeepSpeed counts layers
        over the process; the injection gives each layer its index in its model (:func:`~.replace.build_layer`)."""
        norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if not self.config.use_mup:
            norm_factor = math.sqrt(norm_factor)
        if self.config.scale_attn_by_inverse_layer_idx:
            norm_factor *= math.sqrt(layer_id + 1)
        return norm_factor

    # ------------------------------------------------------------------------------------------- kernels
    def _qkv_gemm(self, input: torch.Tensor, norm_w: torch.Tensor | None,
                  norm_b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qkv, normed input)``: with Pre-LN the input is normed first (``norm_w``/``norm_b``, RMS or layer
        norm), then multiplied by ``attn_qkvw`` and the bias added."""
        normed = input
        if self.config.pre_layer_norm:
            if self.config.norm_type == NormType.RMSNorm:
                normed = kernels.rms_norm(input, norm_w, self.config.epsilon)
            else:
                normed = kernels.layer_norm(input, norm_w, norm_b, self.config.epsilon)
        qkv = torch.matmul(normed.to(self.attn_qkvw.dtype), self.attn_qkvw)
        if self.attn_qkvb is not None:
            qkv = qkv + self.attn_qkvb
        return qkv, normed

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = qkv.shape
        d, h, kv = self.hidden_size_per_attention_head, self.num_attention_heads_per_partition, self.num_kv_partition
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        return tuple(t.reshape(b, s, -1, d).transpose(1, 2) for t in (q, k, v))  # type: ignore[return-value]

    def _softmax_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_mask: Mask,
                         layer_past: Past, positions: torch.Tensor | None, cache_index: int,
                         alibi: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention of the new queries over the cached and new keys: ``(context [b, s, h*d], key, value)``."""
        config = self.config
        b, _, s, _ = q.shape
        past = 0
        if layer_past is not None and not hasattr(layer_past, "update"):
            past = layer_past[0].shape[-2]
        elif layer_past is not None:
            past = layer_past.get_seq_length(cache_index)
        if positions is None:
            positions = torch.arange(past, past + s, device=q.device).expand(b, s)
        if config.rotary_dim > 0:
            half = config.rotate_half and not config.rotate_every_two
            q = rotate(q, config.rotary_dim, positions, config.rope_theta, half)
            k = rotate(k, config.rotary_dim, positions, config.rope_theta, half)
        if layer_past is not None and hasattr(layer_past, "update"):  # a Hugging Face Cache: it keeps the keys
            key, value = layer_past.update(k, v, cache_index)
        elif layer_past is not None:
            key, value = torch.cat([layer_past[0], k], dim=-2), torch.cat([layer_past[1], v], dim=-2)
        else:
            key, value = k, v
        keys = key.shape[-2]
        scale = (1.0 / self.norm_factor) ** 2 if config.scale_attention else 1.0
        kf, vf = key.to(torch.float32), value.to(torch.float32)
        if self.num_kv_partition != self.num_attention_heads_per_partition:  # grouped-query attention
            group = self.num_attention_heads_per_partition // self.num_kv_partition
            kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.to(torch.float32) * scale, kf.transpose(-1, -2))
        if alibi is not None:
            scores = scores + alibi.reshape(b, -1, 1, keys)[:, :scores.shape[1]].to(torch.float32)
        allowed = keep_mask(input_mask, b, s, keys)
        query_at = torch.arange(keys - s, keys, device=q.device)[:, None]
        key_at = torch.arange(keys, device=q.device)[None, :]
        if config.triangular_masking:
            causal = key_at <= query_at
            if config.local_attention:
                causal = causal & (query_at - key_at < config.window_size)
            allowed = causal if allowed is None else allowed & causal
        if allowed is not None:
            scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, vf).to(q.dtype)
        return context.transpose(1, 2).reshape(b, s, -1), key, value

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, input: torch.Tensor, input_mask: Mask, head_mask: torch.Tensor | None = None,
                layer_past: Past = None, get_present: bool = False,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: Mask = None,
                output_attentions: bool = False, norm_w: torch.Tensor | None = None,
                norm_b: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, key, value, context, normed input)``; ``output`` is the projection without its bias, summed
        over the model-parallel group when the MLP follows the attention. ``layer_past`` is a ``(key, value)`` pair
        or a Hugging Face ``Cache`` (updated at ``kwargs["cache_index"]``); ``kwargs["position_ids"]`` places the
        rotary positions."""
        qkv, normed = self._qkv_gemm(input, norm_w, norm_b)
        q, k, v = self._heads(qkv)
        positions = kwargs.get("position_ids")
        context, key, value = self._softmax_context(q, k, v, input_mask, layer_past,
                                                    positions if torch.is_tensor(positions) else None,
                                                    int(kwargs.get("cache_index", 0)), alibi)
        output = torch.matmul(context.to(self.attn_ow.dtype), self.attn_ow)
        if self.config.mlp_after_attn and self.mp_group is not None and dist.get_world_size(group=self.mp_group) > 1:
            dist.all_reduce(output, group=self.mp_group)
        return output, key, value, context, normed


__all__ = ["DeepSpeedSelfAttention", "KVCache", "Mask", "Past", "keep_mask", "minus_inf", "rotate"]
