"""The model families AutoEP knows: Mixtral, Qwen3-MoE (and Qwen2-MoE), Qwen3.5-MoE, DeepSeek-V2 and -V3.

All keep their MoE block at ``model.layers.N.mlp`` with a ``gate`` router and an ``experts`` child holding fused
3-D ``gate_up_proj``/``down_proj`` tensors (Transformers >= 5); they differ in how they route and in what else
the block carries.
"""
from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from dsrun.autoep.presets.adapters import AutoEPPresetAdapter, TransformersTopLevelRouterLogitsAdapter, \
    _retarget_transformers_output_recorders_for_modules
from dsrun.autoep.spec import AutoEPConfig, ForwardContract, GroupRoutingConfig, MoEModelPreset

_COMMON = dict(moe_layer_pattern=r"model\.layers\.\d+\.mlp", router_pattern="gate", experts_pattern="experts",
               expert_storage="fused_3d", expert_w1="gate_up_proj", expert_w2="down_proj", expert_w3=None,
               top_k_attr="num_experts_per_tok", score_apply="post", gate_bias=False)
_NO_EXPERT_BIAS = ("load_balance_coeff / expert-bias auxiliary-loss-free load balancing is not currently supported; "
                   "non-null values are rejected.")

MIXTRAL = MoEModelPreset(**_COMMON, num_experts_attr="num_local_experts", score_func="softmax", route_norm=True,
                         preset_adapter="mixtral", hf_model_types=("mixtral", ), min_transformers_version="5.0.0")

QWEN3_MOE = MoEModelPreset(
    **_COMMON, num_experts_attr="num_experts", score_func="softmax", route_norm=True, has_shared_experts=True,
    shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
    preset_adapter="qwen3_moe", hf_model_types=("qwen3_moe", "qwen2_moe"), min_transformers_version="5.0.0",
    docs_support_notes="Also covers Qwen2-MoE when the installed Transformers build uses the fused expert layout.")

QWEN3_5_MOE = MoEModelPreset(
    **_COMMON, num_experts_attr="num_experts", score_func="softmax", route_norm=True, has_shared_experts=True,
    shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
    preset_adapter="qwen3_5_moe", hf_model_types=("qwen3_5_moe_text", ),
    unsupported_hf_model_type_notes={
        "qwen3_5_moe": ("AutoEP supports the Qwen3.5 text backbone preset path; pass the text-backbone model/config "
                        "with model_type='qwen3_5_moe_text'.")},
    min_transformers_version="5.2.0", docs_support_notes="Requires the Qwen3.5 text-backbone qwen3_5_moe_text model type.")

DEEPSEEK_V2 = MoEModelPreset(
    **_COMMON, num_experts_attr="n_routed_experts", score_func="softmax", route_norm=False, has_shared_experts=True,
    shared_experts_pattern="shared_experts", autoep_config_defaults={"load_balance_coeff": None},
    supports_expert_bias=False, preset_adapter="deepseek_v2", hf_model_types=("deepseek_v2", ),
    min_transformers_version="5.0.0", docs_support_notes=_NO_EXPERT_BIAS)

DEEPSEEK_V3 = MoEModelPreset(
    **_COMMON, num_experts_attr="n_routed_experts", score_func="sigmoid", route_norm=False, has_shared_experts=True,
    shared_experts_pattern="shared_experts", autoep_config_defaults={"load_balance_coeff": None},
    supports_expert_bias=False, unsupported_router_bias_names=(), preset_adapter="deepseek_v3",
    hf_model_types=("deepseek_v3", ), min_transformers_version="5.0.0", docs_support_notes=_NO_EXPERT_BIAS)


class _HFOnlyAdapter(AutoEPPresetAdapter):
    def _requires_transformers_version_validation(self) -> bool:
        return True


class DeepSeekV2PresetAdapter(_HFOnlyAdapter):
    """DeepSeek-V2 keeps its own top-k normalisation; ``topk_method="group_limited_greedy"`` routes within groups
    scored by their best expert."""

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config) -> bool:
        return config.route_norm if config.route_norm is not None else preset.route_norm

    def resolve_group_routing(self, config: AutoEPConfig, model_config) -> GroupRoutingConfig:
        own = super().resolve_group_routing(config, model_config)
        if getattr(model_config, "topk_method", None) != "group_limited_greedy":
            return own
        return GroupRoutingConfig(own.num_expert_groups or getattr(model_config, "n_group", None),
                                  own.num_limited_groups or getattr(model_config, "topk_group", None), "max")


def _has_projection(expert: nn.Module, name: str) -> bool:
    projection = getattr(expert, name, None)
    return projection is not None and (isinstance(projection, (nn.Linear, nn.Parameter)) or hasattr(projection, "weight"))


class DeepSeekV3PresetAdapter(_HFOnlyAdapter):
    """DeepSeek-V3 always routes within expert groups (``n_group``/``topk_group``); older checkpoints keep experts as
    a ModuleList of gate/up/down projections."""

    def resolve_group_routing(self, config: AutoEPConfig, model_config) -> GroupRoutingConfig:
        own = super().resolve_group_routing(config, model_config)
        return GroupRoutingConfig(own.num_expert_groups or getattr(model_config, "n_group", None),
                                  own.num_limited_groups or getattr(model_config, "topk_group", None),
                                  own.group_score_func)

    def resolve_expert_layout(self, experts_module: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        if not isinstance(experts_module, nn.ModuleList) or len(experts_module) == 0:
            return preset
        fused_default = (preset.expert_storage == "fused_3d" and preset.expert_w1 == "gate_up_proj"
                         and preset.expert_w2 == "down_proj" and preset.expert_w3 is None)
        if not fused_default or not all(_has_projection(experts_module[0], n) for n in ("gate_proj", "up_proj", "down_proj")):
            return preset
        return replace(preset, expert_storage="module_list", expert_w1="gate_proj", expert_w2="down_proj",
                       expert_w3="up_proj")


class Qwen35MoePresetAdapter(_HFOnlyAdapter):
    """Qwen3.5-MoE records router output from its router module; the replaced block returns it as output 1."""

    def adjust_forward_contract(self, contract: ForwardContract) -> ForwardContract:
        return replace(contract, return_router_logits=True, capture_target="router", capture_index=1)

    def retarget_transformers_output_recorders(self, model, spec, replacement, retargeted_keys,
                                               remove_output_capture_hooks) -> None:
        cls = replacement.__class__

        def matches(module: nn.Module) -> bool:
            model_type = getattr(getattr(module, "config", None), "model_type", None)
            return model_type == "qwen3_5_moe_text" or "Qwen3_5Moe" in module.__class__.__name__

        _retarget_transformers_output_recorders_for_modules(
            model=model, display_name="Qwen3.5 AutoEP",
            recorder_key=f"{spec.model_family}:{cls.__module__}.{cls.__qualname__}", retargeted_keys=retargeted_keys,
            remove_output_capture_hooks=remove_output_capture_hooks, module_matches=matches,
            make_output_recorder=lambda recorder: recorder(cls, index=1))


PRESETS = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "qwen3_5_moe": QWEN3_5_MOE, "deepseek_v2": DEEPSEEK_V2,
           "deepseek_v3": DEEPSEEK_V3}
ADAPTERS = {
    "mixtral": TransformersTopLevelRouterLogitsAdapter(display_name="Mixtral", hf_model_types=("mixtral", ),
                                                       class_name_fragments=("Mixtral", )),
    "qwen3_moe": TransformersTopLevelRouterLogitsAdapter(display_name="Qwen3-MoE/Qwen2-MoE",
                                                         hf_model_types=("qwen3_moe", "qwen2_moe"),
                                                         class_name_fragments=("Qwen3Moe", "Qwen2Moe")),
    "qwen3_5_moe": Qwen35MoePresetAdapter(),
    "deepseek_v2": DeepSeekV2PresetAdapter(),
    "deepseek_v3": DeepSeekV3PresetAdapter(),
}
