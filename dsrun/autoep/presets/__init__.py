"""AutoEP's model-family presets and the lookup by name or by a Hugging Face ``model_type`` (DeepSpeed's
``auto_ep_presets.registry``); the presets are in :mod:`.families`, their adapters in :mod:`.adapters`."""
from __future__ import annotations

import copy
from dataclasses import replace

from dsrun.autoep.presets import families
from dsrun.autoep.presets.adapters import (  # DeepSpeed's auto_ep_presets.base names too
    AutoEPPresetAdapter, TransformersTopLevelRouterLogitsAdapter, _retarget_transformers_output_recorders_for_modules)
from dsrun.autoep.spec import (
    _UNSET, AutoEPConfig, ForwardContract, GroupRoutingConfig, MoELayerSpec, MoEModelPreset,
    _raise_unsupported_load_balance_coeff)
from dsrun.utils.logging import logger

__all__ = ["PRESET_MODELS", "AutoEPPresetAdapter", "TransformersTopLevelRouterLogitsAdapter",
           "_retarget_transformers_output_recorders_for_modules", "_UNSET", "AutoEPConfig", "ForwardContract",
           "GroupRoutingConfig", "MoELayerSpec", "MoEModelPreset", "_raise_unsupported_load_balance_coeff",
           "available_preset_names", "get_preset", "get_preset_adapter", "preset_name_for_hf_model_type",
           "unsupported_preset_for_hf_model_type", "resolve_autoep_config_defaults", "apply_config_overrides",
           "resolve_preset_candidates"]

PRESET_MODELS: dict[str, MoEModelPreset] = dict(families.PRESETS)
_PRESET_ADAPTERS: dict[str, AutoEPPresetAdapter] = {"default": AutoEPPresetAdapter(), **families.ADAPTERS}
_missing = [f"{name}:{p.preset_adapter}" for name, p in PRESET_MODELS.items() if p.preset_adapter not in _PRESET_ADAPTERS]
if _missing:
    raise RuntimeError(f"AutoEP preset registry is inconsistent; missing preset_adapter registration(s): "
                       f"{', '.join(_missing)}")


def available_preset_names() -> tuple[str, ...]:
    return tuple(PRESET_MODELS)


def get_preset(preset_name: str) -> MoEModelPreset:
    preset = PRESET_MODELS.get(preset_name)
    if preset is None:
        raise ValueError(f"Unknown preset_model '{preset_name}'. Available presets: {list(available_preset_names())}")
    return preset


def get_preset_adapter(adapter_name: str) -> AutoEPPresetAdapter:
    adapter = _PRESET_ADAPTERS.get(adapter_name)
    if adapter is None:
        raise ValueError(f"Unknown AutoEP preset adapter '{adapter_name}'")
    return adapter


def preset_name_for_hf_model_type(model_type: str) -> str | None:
    """The preset serving a Hugging Face ``model_type``, or None."""
    return next((name for name, p in PRESET_MODELS.items() if model_type in p.hf_model_types), None)


def unsupported_preset_for_hf_model_type(model_type: str) -> tuple[str, MoEModelPreset] | None:
    """The preset that carries a note on why ``model_type`` is not supported (and what to pass instead), or None."""
    return next(((name, p) for name, p in PRESET_MODELS.items() if model_type in p.unsupported_hf_model_type_notes),
                None)


def resolve_autoep_config_defaults(config: AutoEPConfig, preset_name: str | None) -> AutoEPConfig:
    """``config`` with the preset's own defaults where the user set nothing (a copy when anything changes)."""
    defaults = PRESET_MODELS[preset_name].autoep_config_defaults if preset_name in PRESET_MODELS else {}
    if "load_balance_coeff" not in defaults or config._load_balance_coeff_explicit:
        return config
    resolved = copy.copy(config)
    resolved.load_balance_coeff = defaults["load_balance_coeff"]
    return resolved


_OVERRIDES = (("moe_layer_pattern", "moe_layer_pattern"), ("router_pattern", "router_pattern"),
              ("expert_pattern", "experts_pattern"), ("expert_w1", "expert_w1"), ("expert_w2", "expert_w2"),
              ("num_experts_attr", "num_experts_attr"), ("top_k_attr", "top_k_attr"),
              ("has_shared_experts", "has_shared_experts"), ("shared_experts_pattern", "shared_experts_pattern"),
              ("shared_experts_gate_pattern", "shared_experts_gate_pattern"))


def apply_config_overrides(config: AutoEPConfig, preset: MoEModelPreset) -> MoEModelPreset:
    """The preset with the user's explicit names in place of its own (the registered preset is left alone)."""
    overrides = {field: getattr(config, key) for key, field in _OVERRIDES if getattr(config, key) is not None}
    if config.expert_w3 is not _UNSET:
        overrides["expert_w3"] = config.expert_w3
    return replace(preset, **overrides) if overrides else preset


def resolve_preset_candidates(config: AutoEPConfig, model_config) -> list[tuple[str, MoEModelPreset]]:
    """The presets to try, in order: the named one; else the one for the model's ``model_type``; else a custom
    preset from ``moe_layer_pattern``; else every preset."""
    def chosen(name: str) -> list[tuple[str, MoEModelPreset]]:
        preset = apply_config_overrides(config, get_preset(name))
        get_preset_adapter(preset.preset_adapter).validate_compatibility(name, preset, model_config)
        return [(name, preset)]

    if config.preset_model is not None:
        return chosen(config.preset_model)
    model_type = getattr(model_config, "model_type", None) if model_config is not None else None
    if model_type:
        name = preset_name_for_hf_model_type(model_type)
        if name is not None:
            logger.info(f"AutoEP: auto-detected model_type='{model_type}', using preset '{name}'")
            return chosen(name)
        unsupported = unsupported_preset_for_hf_model_type(model_type)
        if unsupported is not None:
            name, preset = unsupported
            get_preset_adapter(preset.preset_adapter).validate_compatibility(name, preset, model_config)
    if config.moe_layer_pattern:
        return [("custom", _custom_preset(config))]
    return [(name, apply_config_overrides(config, preset)) for name, preset in PRESET_MODELS.items()]


def _custom_preset(config: AutoEPConfig) -> MoEModelPreset:
    def auto(value, default):
        return default if value in (None, "auto") else value

    return MoEModelPreset(
        moe_layer_pattern=config.moe_layer_pattern, router_pattern=config.router_pattern or "gate",
        experts_pattern=config.expert_pattern or "experts", expert_storage="fused_3d",
        expert_w1=config.expert_w1 or "gate_up_proj", expert_w2=config.expert_w2 or "down_proj",
        expert_w3=None if config.expert_w3 is _UNSET else config.expert_w3,
        num_experts_attr=config.num_experts_attr or "num_local_experts",
        top_k_attr=config.top_k_attr or "num_experts_per_tok", score_func=auto(config.score_func, "softmax"),
        score_apply=auto(config.score_apply, "post"), route_norm=auto(config.route_norm, True), gate_bias=False,
        has_shared_experts=auto(config.has_shared_experts, False),
        shared_experts_pattern=config.shared_experts_pattern or "",
        shared_experts_gate_pattern=config.shared_experts_gate_pattern or "")
