"""``deepspeed.inference.v2.model_implementations.common_parameters``: the parameters Transformer containers are
made of. Each finalizes through the inference model's ``transform_*_param`` (which shards and converts); the
fused forms are assembled first (q|k|v, gate|up interleaved row by row, experts stacked).

No ``from __future__ import annotations`` here: the dependency annotations must be the classes themselves."""

import torch

from .parameter_base import ParameterBase, ParamList

Experts = ParamList("n_experts")  # one tensor per expert: as many as the inference model's ``n_experts``


class AttentionOutputParameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_attn_out_param(self.params)


class EmbeddingParameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_embedding_param(self.params)


class InvFreqParameter(ParameterBase):
    """Trained rotary inverse frequencies, in the model's activation dtype."""
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.params.to(self.inference_model.activation_dtype.value)


def _interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up rows alternating (gate 0, up 0, gate 1, ...): the layout the gated activation reads."""
    if gate.shape[0] != up.shape[0]:
        raise ValueError(f"Gated MLP parameters must have the same number of neurons, got {gate.shape[0]} and "
                         f"{up.shape[0]}")
    return torch.cat([gate, up], dim=-1).reshape(gate.shape[0] + up.shape[0], -1)


class MLP1Parameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_mlp_1_param(self.params)


class GatedMLPParameter(ParameterBase):
    gate_params: torch.Tensor
    up_params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_mlp_1_param(_interleave_rows(self.gate_params, self.up_params))


class FusedGatedMLPParameter(ParameterBase):
    """One tensor holding the gate rows, then the up rows."""
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        gate, up = self.params.chunk(2, dim=0)
        return self.inference_model.transform_mlp_1_param(_interleave_rows(gate, up))


class MLP2Parameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_mlp_2_param(self.params)


class MoEGatingWeightParameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_moe_gate_param(self.params)


class UnfusedMoEMLP1Parameter(ParameterBase):
    """Experts held as separate tensors, stacked into one ``[n_experts, ...]``."""
    experts: Experts

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_moe_mlp_1_param(torch.stack(list(self.experts), dim=0))


class UnfusedMoEMLP2Parameter(ParameterBase):
    experts: Experts

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_moe_mlp_2_param(torch.stack(list(self.experts), dim=0))


class UnfusedMoEGatedMLPParameter(ParameterBase):
    """Each expert's gate and up tensors, interleaved per expert and stacked."""
    gating_experts: Experts
    up_experts: Experts

    def finalize(self) -> torch.Tensor:
        fused = [_interleave_rows(gate, up) for gate, up in zip(self.gating_experts, self.up_experts)]
        return self.inference_model.transform_moe_mlp_1_param(torch.stack(fused, dim=0))


class NormParameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_norm_param(self.params)


class FusedQKVParameter(ParameterBase):
    """All q heads, then all k heads, then all v heads, in one tensor."""
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_qkv_param(self.params)


class UnfusedQKVParameter(ParameterBase):
    q_params: torch.Tensor
    k_params: torch.Tensor
    v_params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_qkv_param(torch.cat([self.q_params, self.k_params, self.v_params]))


def megatron_qkv_reshape(param: torch.Tensor, head_size: int, n_heads: int) -> torch.Tensor:
    """Megatron's per-head interleaved q|k|v (q0 k0 v0 q1 k1 v1 ...) as all q, all k, all v."""
    if param.shape[0] != 3 * n_heads * head_size:
        raise ValueError(f"Megatron QKV: expected {3 * n_heads * head_size} rows, got {param.shape[0]}")
    heads = param.chunk(3 * n_heads, dim=0)
    return torch.cat(heads[0::3] + heads[1::3] + heads[2::3], dim=0)


def transform_gqa_megatron(src_param: torch.Tensor, head_size: int, n_q_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Megatron's grouped layout (per kv group: its q heads, its k, its v) as all q, all k, all v."""
    if src_param.shape[0] != (2 * n_kv_heads + n_q_heads) * head_size:
        raise ValueError(f"Megatron GQA QKV: expected {(2 * n_kv_heads + n_q_heads) * head_size} rows, got "
                         f"{src_param.shape[0]}")
    ratio = n_q_heads // n_kv_heads
    groups = src_param.reshape(n_kv_heads, 2 + ratio, head_size, -1)
    q = groups[:, :ratio].reshape(-1, groups.shape[-1])
    k = groups[:, ratio].reshape(-1, groups.shape[-1])
    v = groups[:, ratio + 1].reshape(-1, groups.shape[-1])
    return torch.cat([q, k, v], dim=0).squeeze()


class MegatronQKVParameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        model = self.inference_model
        return model.transform_qkv_param(megatron_qkv_reshape(self.params, model.head_size, model.n_heads))


class GQAMegatronQKVParameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        model = self.inference_model
        return model.transform_qkv_param(
            transform_gqa_megatron(self.params, model.head_size, model.n_heads_q, model.n_heads_kv))


class UnembedParameter(ParameterBase):
    params: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return self.inference_model.transform_unembed_param(self.params)


__all__ = ["AttentionOutputParameter", "Experts", "EmbeddingParameter", "FusedGatedMLPParameter", "FusedQKVParameter",
           "GQAMegatronQKVParameter", "GatedMLPParameter", "InvFreqParameter", "MLP1Parameter", "MLP2Parameter",
           "MegatronQKVParameter", "MoEGatingWeightParameter", "NormParameter", "UnembedParameter",
           "UnfusedMoEGatedMLPParameter", "UnfusedMoEMLP1Parameter", "UnfusedMoEMLP2Parameter",
           "UnfusedQKVParameter", "megatron_qkv_reshape", "transform_gqa_megatron"]
