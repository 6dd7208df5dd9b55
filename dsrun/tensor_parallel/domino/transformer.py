"""Domino's Transformer (DeepSpeed's ``runtime.domino.transformer``): Megatron's layer in ``[s, b, h]``, split
over a tensor-parallel group, with the batch cut in two halves whose communication overlaps the other half's
computation (the package docstring).

Built from Megatron's config object (``hidden_size``, ``num_attention_heads``, ``kv_channels``,
``ffn_hidden_size``, ``num_layers``, ``layernorm_epsilon``, ``hidden_dropout``, ``attention_dropout``,
``add_bias_linear``, ``apply_residual_connection_post_layernorm``, ``params_dtype``, ``init_method``,
``output_layer_init_method``, ``perform_initialization``, ``domino_intra_layer_overlap``) and an ``mpu``
(``get_tensor_model_parallel_world_size()``, ``get_tensor_model_parallel_group()``).

Where dsrun differs from DeepSpeed 0.19.8, each on purpose:

- attention dropout applies in training only (DeepSpeed's also applies in ``eval()``);
- what DeepSpeed accepts and then ignores is refused with one line: ``gated_linear_unit``, a
  ``drop_path_rate`` above 0, a padding attention-mask type, an ``attention_mask`` that is not causal
  (attention is always causal), a batch that cannot be cut in two;
- the backward wait sits on the column-parallel layer's own input, so with
  ``apply_residual_connection_post_layernorm`` the residual's gradient is added to the reduced one (in
  DeepSpeed's placement the two meet before the reduction has finished).
"""
from __future__ import annotations

import enum
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from dsrun import comm

from .async_linear import (DominoAsyncColumnParallelLinear, MegatronConfig, PendingReduce, RowParallelLinearNoComm,
                           Waitable)


class TensorParallelUnit(Protocol):
    """Megatron's ``mpu``, as far as Domino asks it."""

    def get_tensor_model_parallel_world_size(self) -> int: ...

    def get_tensor_model_parallel_group(self) -> torch.distributed.ProcessGroup | None: ...


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2


class DominoUtil:
    """The two half batches' names, and the pending input-gradient reductions, one slot per half."""

    BATCH_0 = "BATCH0"
    BATCH_1 = "BATCH1"
    HANDLE_DIC: dict[str, Waitable | None] = {"BATCH0": None, "BATCH1": None}


class DominoModule(torch.nn.Module):
    """The base class of Domino's modules."""


class NoOper(torch.autograd.Function):
    """Identity forward; backward waits for the pending reduction of ``handle_dic[h_id]`` and passes on the
    reduced gradient."""

    @staticmethod
    def forward(ctx, input_, handle_dic, h_id):
        ctx.handle_dic, ctx.h_id = handle_dic, h_id
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        pending = ctx.handle_dic.get(ctx.h_id)
        ctx.handle_dic[ctx.h_id] = None
        if pending is None:
            return grad_output, None, None
        if not isinstance(pending, PendingReduce):  # a bare work handle: the reduction is in place
            pending.wait()
            return grad_output, None, None
        reduced = pending.wait()
        return (reduced if reduced.shape == grad_output.shape else grad_output), None, None


def _Wait_bwd_comm(input_: torch.Tensor, dic_: dict, h_id: str) -> torch.Tensor:
    """``input_`` unchanged; in backward, its gradient is the all-reduced one that ``dic_[h_id]`` is waiting for."""
    return NoOper.apply(input_, dic_, h_id)


def _layer_norm(config: MegatronConfig) -> torch.nn.LayerNorm:
    """A layer norm in the parameters' dtype (DeepSpeed's is in torch's default dtype until the model is cast)."""
    return torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                              dtype=getattr(config, "params_dtype", None))


def _require(ok: bool, what: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"Domino: {what}; expected {expected}")


class CoreAttention(DominoModule):
    """Causal scaled-dot-product attention over this rank's heads: ``[b, np, s, hn]`` in, ``[s, b, np*hn]`` out."""

    def __init__(self, config: MegatronConfig, tp_world_size: int, attn_mask_type: AttnMaskType = AttnMaskType.causal):
        super().__init__()
        _require(attn_mask_type == AttnMaskType.causal, f"attn_mask_type {attn_mask_type}",
                 "AttnMaskType.causal (Domino's attention is causal only)")
        projection = config.kv_channels * config.num_attention_heads
        _require(projection % tp_world_size == 0, f"projection size {projection}",
                 f"a multiple of the tensor-parallel size {tp_world_size}")
        self.attn_mask_type = attn_mask_type
        self.hidden_size_per_partition = projection // tp_world_size
        self.attention_dropout_rate = config.attention_dropout

    @staticmethod
    def _check_mask(mask: torch.Tensor | None, seq: int) -> None:
        """Every call (a mask may change from batch to batch): the attention is causal, so a mask must be."""
        if mask is None:
            return
        causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)  # True: masked (Megatron)
        ok = mask.dtype == torch.bool and mask.shape[-2:] == (seq, seq) and bool((mask == causal).all())
        _require(ok, "attention_mask is not the causal mask",
                 "None or Megatron's causal mask (True above the diagonal): Domino's attention is causal only")

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        self._check_mask(attention_mask, query_layer.shape[2])
        context = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, is_causal=True,
                                                 dropout_p=self.attention_dropout_rate if self.training else 0.0)
        context = context.permute(2, 0, 1, 3).contiguous()  # [s, b, np, hn]
        return context.view(*context.shape[:-2], self.hidden_size_per_partition)


class ShardedAttention(DominoModule):
    """Self-attention over this rank's ``num_attention_heads / tp`` heads: a column-parallel QKV projection
    (per head: query, key, value rows together), causal attention, and a row-parallel output projection whose
    partial sum the caller all-reduces."""

    def __init__(self, config: MegatronConfig, mpu: TensorParallelUnit, apply_rotary_pos_emb: Callable | None, layer_number: int,
                 attention_type: AttnType = AttnType.self_attn, attn_mask_type: AttnMaskType = AttnMaskType.causal):
        super().__init__()
        _require(attention_type == AttnType.self_attn, f"attention_type {attention_type}", "AttnType.self_attn")
        tp = mpu.get_tensor_model_parallel_world_size()
        _require(config.num_attention_heads % tp == 0, f"{config.num_attention_heads} attention heads",
                 f"a multiple of the tensor-parallel size {tp}")
        self.layer_number = max(1, layer_number)
        self.attention_type, self.attn_mask_type = attention_type, attn_mask_type
        self.params_dtype = getattr(config, "params_dtype", torch.float32)
        self.apply_rotary_pos_emb = apply_rotary_pos_emb
        projection = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.query_key_value = DominoAsyncColumnParallelLinear(
            config.hidden_size, 3 * projection // tp, mpu.get_tensor_model_parallel_group(), config=config,
            init_method=config.init_method, bias=config.add_bias_linear)
        self.core_attention = CoreAttention(config, tp, attn_mask_type)
        self.dense = RowParallelLinearNoComm(projection // tp, config.hidden_size, config=config,
                                             init_method=config.output_layer_init_method,
                                             bias=config.add_bias_linear, skip_bias_add=True)

    def domino_core_attention_forward(self, mixed_x_layer, attention_mask, rotary_pos_emb=None):
        """The attention of the projected ``[s, b, 3*np*hn]`` (per head: q, k, v): ``[s, b, np*hn]``."""
        hn = self.hidden_size_per_attention_head
        heads = mixed_x_layer.view(*mixed_x_layer.shape[:-1], self.num_attention_heads_per_partition, 3 * hn)
        query, key, value = heads.permute(1, 2, 0, 3).contiguous().split(hn, dim=3)  # each [b, np, s, hn]
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query, key = self.apply_rotary_pos_emb(query, q_emb), self.apply_rotary_pos_emb(key, k_emb)
        return self.core_attention(query, key, value, attention_mask)

    def forward(self, hidden_states, attention_mask, micro_batch_num, rotary_pos_emb=None):
        # waits for its own input gradient's reduction (a caller's wait placed above finds nothing pending)
        hidden_states = _Wait_bwd_comm(hidden_states, DominoUtil.HANDLE_DIC, micro_batch_num)
        mixed, _ = self.query_key_value(hidden_states, DominoUtil.HANDLE_DIC, micro_batch_num)
        return self.dense(self.domino_core_attention_forward(mixed, attention_mask, rotary_pos_emb))


class bias_dropout_add(torch.nn.Module):
    """``dropout(x + bias) + residual``."""

    def __init__(self, prob: float):
        super().__init__()
        self.dropout = torch.nn.Dropout(prob)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        return self.dropout(x if bias is None else x + bias) + residual


class DominoTransformerLayer(DominoModule):
    """One Transformer layer over the two half batches, ``(h0, h1) -> (h0, h1)``, each ``[s, b/2, h]``: the
    halves' all-reduces overlap each other's computation within the layer."""

    def __init__(self, config: MegatronConfig, mpu: TensorParallelUnit, apply_rotary_pos_emb: Callable | None, layer_number: int,
                 layer_type: LayerType = LayerType.encoder, self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 drop_path_rate: float = 0.0):
        super().__init__()
        _require(not getattr(config, "gated_linear_unit", False), "config.gated_linear_unit is true",
                 "false (Domino's MLP is fc1, GeLU, fc2; DeepSpeed ignores the setting)")
        _require(drop_path_rate == 0, f"drop_path_rate {drop_path_rate}", "0 (Domino has no drop path)")
        self.layer_number, self.layer_type = layer_number, layer_type
        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm
        self.llama_model = False
        self.input_layernorm = _layer_norm(config)
        self.self_attention = ShardedAttention(config, mpu, apply_rotary_pos_emb, layer_number,
                                               attn_mask_type=self_attn_mask_type)
        self.hidden_dropout = config.hidden_dropout
        self.post_attention_layernorm = _layer_norm(config)
        tp = mpu.get_tensor_model_parallel_world_size()
        _require(config.ffn_hidden_size % tp == 0, f"ffn_hidden_size {config.ffn_hidden_size}",
                 f"a multiple of the tensor-parallel size {tp}")
        self.TP_group = mpu.get_tensor_model_parallel_group()
        self.output_size_c = self.input_size_r = config.ffn_hidden_size
        self.input_size_c = self.output_size_r = config.hidden_size
        self.output_size_per_partition = self.input_size_per_partition = config.ffn_hidden_size // tp
        self.linear_fc1 = DominoAsyncColumnParallelLinear(config.hidden_size, self.output_size_per_partition,
                                                          self.TP_group, config=config,
                                                          init_method=config.init_method,
                                                          bias=config.add_bias_linear)
        self.mlp_activation_func = F.gelu
        self.linear_fc2 = RowParallelLinearNoComm(self.input_size_per_partition, config.hidden_size, config=config,
                                                  init_method=config.output_layer_init_method,
                                                  bias=config.add_bias_linear, skip_bias_add=True)
        self.bias_dropout_add_func = bias_dropout_add(self.hidden_dropout)

    # The steps of one half batch, which the schedules interleave.
    def attention_in(self, ln: torch.Tensor, half: str, mask: torch.Tensor | None,
                     rotary: torch.Tensor | tuple | None) -> torch.Tensor:
        """This rank's attention of the normed ``ln`` (``[s, b/2, np*hn]``), before the output projection."""
        attn = self.self_attention
        mixed, _ = attn.query_key_value(_Wait_bwd_comm(ln, DominoUtil.HANDLE_DIC, half), DominoUtil.HANDLE_DIC, half)
        return attn.domino_core_attention_forward(mixed, mask, rotary_pos_emb=rotary)

    def reduce_start(self, partial: torch.Tensor) -> Waitable:
        """Start the all-reduce of a row-parallel partial sum, in place and outside autograd (its backward is the
        identity: every rank's output gradient is already the whole one)."""
        return comm.all_reduce(partial.detach(), group=self.TP_group, async_op=True)

    def after_attention(self, hidden: torch.Tensor, ln: torch.Tensor, out: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual and second norm once the attention output is reduced: ``(normed, residual for the MLP)``."""
        x = self.bias_dropout_add_func(out, bias, ln if self.apply_residual_connection_post_layernorm else hidden)
        ln2 = self.post_attention_layernorm(x)
        return ln2, (ln2 if self.apply_residual_connection_post_layernorm else x)

    def mlp_in(self, ln2: torch.Tensor, half: str) -> torch.Tensor:
        out, _ = self.linear_fc1(_Wait_bwd_comm(ln2, DominoUtil.HANDLE_DIC, half), DominoUtil.HANDLE_DIC, half)
        return self.mlp_activation_func(out)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        h0, h1 = hidden_states
        b0, b1 = DominoUtil.BATCH_0, DominoUtil.BATCH_1
        ln0 = self.input_layernorm(h0)
        out0, bias0 = self.self_attention.dense(self.attention_in(ln0, b0, attention_mask, rotary_pos_emb))
        work0 = self.reduce_start(out0)
        ln1 = self.input_layernorm(h1)
        out1, bias1 = self.self_attention.dense(self.attention_in(ln1, b1, attention_mask, rotary_pos_emb))
        work1 = self.reduce_start(out1)
        work0.wait()
        ln2_0, res0 = self.after_attention(h0, ln0, out0, bias0)
        act0 = self.mlp_in(ln2_0, b0)
        work1.wait()
        ln2_1, res1 = self.after_attention(h1, ln1, out1, bias1)
        y0, fc2_bias = self.linear_fc2(act0)
        work0 = self.reduce_start(y0)
        y1, _ = self.linear_fc2(self.mlp_in(ln2_1, b1))
        work1 = self.reduce_start(y1)
        work0.wait()
        h0 = self.bias_dropout_add_func(y0, fc2_bias, res0)
        work1.wait()
        return h0, self.bias_dropout_add_func(y1, fc2_bias, res1)


class DominoTransformer(DominoModule):
    """``num_layers`` Domino layers and the final norm, ``[s, b, h] -> [s, b, h]``; ``b`` is cut in two halves.
    The default schedule overlaps across layer boundaries (half 1's last reduction of a layer runs under half
    0's attention of the next); ``config.domino_intra_layer_overlap`` keeps the overlap within each layer."""

    def __init__(self, config: MegatronConfig, mpu: TensorParallelUnit, apply_rotary_pos_emb: Callable | None, model_type: object,
                 layer_type: LayerType = LayerType.encoder, self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 post_layer_norm: bool = True, pre_process: bool = True, post_process: bool = True,
                 drop_path_rate: float = 0.0):
        super().__init__()
        if not comm.is_initialized():
            comm.init_distributed()
        self.layer_type, self.model_type = layer_type, model_type
        self.post_layer_norm, self.post_process = post_layer_norm, post_process
        self.input_tensor = None
        self.drop_path_rate = drop_path_rate
        self.TP_group = mpu.get_tensor_model_parallel_group()
        self.num_layers = config.num_layers
        self.layers = torch.nn.ModuleList([
            DominoTransformerLayer(config, mpu, apply_rotary_pos_emb, i + 1, layer_type=layer_type,
                                   self_attn_mask_type=self_attn_mask_type, drop_path_rate=drop_path_rate)
            for i in range(self.num_layers)])
        if post_process and post_layer_norm:
            self.final_layernorm = _layer_norm(config)
        self.intra_layer_overlap = bool(getattr(config, "domino_intra_layer_overlap", False))
        self._forward_impl = (self.intra_layer_overlap_forward if self.intra_layer_overlap
                              else self.inter_layer_overlap_forward)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        _require(hidden_states.dim() == 3 and hidden_states.shape[1] >= 2 and hidden_states.shape[1] % 2 == 0,
                 f"hidden_states of shape {tuple(hidden_states.shape)}",
                 "[sequence, batch, hidden] with an even batch (Domino runs the two halves interleaved)")
        return self._forward_impl(hidden_states, attention_mask, rotary_pos_emb)

    def _finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(h) if self.post_process and self.post_layer_norm else h

    def intra_layer_overlap_forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        halves = tuple(torch.chunk(hidden_states, 2, dim=1))
        for layer in self.layers:
            halves = layer(halves, attention_mask, rotary_pos_emb)
        return torch.cat([self._finish(h) for h in halves], dim=1)

    def inter_layer_overlap_forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        h0, h1 = torch.chunk(hidden_states, 2, dim=1)
        b0, b1 = DominoUtil.BATCH_0, DominoUtil.BATCH_1
        work1 = y1 = fc2_bias = res1 = None
        ln0 = self.layers[0].input_layernorm(h0)
        for index, layer in enumerate(self.layers):
            ctx0 = layer.attention_in(ln0, b0, attention_mask, rotary_pos_emb)
            if index > 0:  # half 1 leaves the previous layer: its MLP reduction ran under half 0's attention
                work1.wait()
                h1 = self.layers[index - 1].bias_dropout_add_func(y1, fc2_bias, res1)
            ln1 = layer.input_layernorm(h1)
            out0, bias0 = layer.self_attention.dense(ctx0)
            work0 = layer.reduce_start(out0)
            ctx1 = layer.attention_in(ln1, b1, attention_mask, rotary_pos_emb)
            work0.wait()
            ln2_0, res0 = layer.after_attention(h0, ln0, out0, bias0)
            out1, bias1 = layer.self_attention.dense(ctx1)
            work1 = layer.reduce_start(out1)
            act0 = layer.mlp_in(ln2_0, b0)
            work1.wait()
            ln2_1, res1 = layer.after_attention(h1, ln1, out1, bias1)
            y0, fc2_bias = layer.linear_fc2(act0)
            work0 = layer.reduce_start(y0)
            act1 = layer.mlp_in(ln2_1, b1)
            work0.wait()
            h0 = layer.bias_dropout_add_func(y0, fc2_bias, res0)
            if index < self.num_layers - 1:
                ln0 = self.layers[index + 1].input_layernorm(h0)
            y1, fc2_bias = layer.linear_fc2(act1)
            work1 = layer.reduce_start(y1)
        h0 = self._finish(h0)
        work1.wait()
        h1 = self._finish(self.layers[-1].bias_dropout_add_func(y1, fc2_bias, res1))
        return torch.cat([h0, h1], dim=1)
