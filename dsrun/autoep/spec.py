"""AutoEP's data: the user's ``expert_parallel`` settings, a model family's preset, one detected MoE layer.

:class:`AutoEPConfig` is the ``expert_parallel`` config section; :class:`MoEModelPreset` says where a family keeps
its router and experts and how it routes; :class:`MoELayerSpec` is what detection found for one MoE block, and
all the replacement layer is built from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# the expert_parallel section itself is the config's (dsrun.config.expert_parallel): re-exported here
from dsrun.config.expert_parallel import _UNSET, AutoEPConfig, _raise_unsupported_load_balance_coeff

__all__ = ["_UNSET", "AutoEPConfig", "_raise_unsupported_load_balance_coeff", "MoEModelPreset", "MoELayerSpec",
           "GroupRoutingConfig", "ForwardContract"]



@dataclass
class MoEModelPreset:
    """Where a model family keeps its MoE parts (attribute names, a regex for the block's path) and how it routes."""

    moe_layer_pattern: str
    router_pattern: str
    experts_pattern: str
    expert_storage: Literal["fused_3d", "module_list"]
    expert_w1: str
    expert_w2: str
    expert_w3: str | None
    num_experts_attr: str
    top_k_attr: str
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    gate_bias: bool
    has_shared_experts: bool = False
    shared_experts_pattern: str = ""
    shared_experts_gate_pattern: str = ""
    autoep_config_defaults: dict[str, Any] = field(default_factory=dict)
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    hf_model_types: tuple[str, ...] = ()
    unsupported_hf_model_type_notes: dict[str, str] = field(default_factory=dict)
    min_transformers_version: str | None = None
    validated_transformers_versions: str = ""
    docs_support_notes: str = ""


@dataclass
class MoELayerSpec:
    """One detected MoE block: its path, its parts' names and sizes, and its routing."""

    moe_module_name: str
    model_family: str
    router_name: str
    experts_name: str
    expert_storage: Literal["fused_3d", "module_list"]
    expert_w1_name: str
    expert_w2_name: str
    expert_w3_name: str | None
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    gate_bias: bool
    return_router_logits: bool
    router_logits_capture_target: Literal["moe_block", "router", "none"]
    router_logits_capture_index: int | None
    router_logits_capture_layer_name: str | None
    has_shared_experts: bool
    shared_experts_name: str
    shared_experts_gate_name: str = ""
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    router_logits_capture_mode: Literal["raw", "post_score"] = "post_score"
    moe_output_shape: Literal["batched", "flat"] = "batched"


@dataclass(frozen=True)
class GroupRoutingConfig:
    """Group-limited routing: experts in ``num_expert_groups`` groups, tokens choose within the best
    ``num_limited_groups`` (DeepSeek's node-limited routing)."""
    num_expert_groups: int | None
    num_limited_groups: int | None
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"


@dataclass(frozen=True)
class ForwardContract:
    """What the replaced block's callers expect back: router logits returned or captured, output shape."""
    return_router_logits: bool = False
    capture_target: Literal["moe_block", "router", "none"] = "none"
    capture_index: int | None = None
    capture_layer_name: str | None = None
    router_logits_capture_mode: Literal["raw", "post_score"] = "post_score"
    moe_output_shape: Literal["batched", "flat"] = "batched"
