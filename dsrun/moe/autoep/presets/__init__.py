"""AutoEP's model-family presets, their adapters (what differs per family beyond names) and the lookup by name
or by a Hugging Face ``model_type``. The presets themselves are in :mod:`.families`."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable

import torch.nn as nn
from packaging.version import InvalidVersion, Version

from dsrun.moe.autoep.spec import (  # noqa: F401  (DeepSpeed's auto_ep_presets.base names)
    _UNSET, AutoEPConfig, ForwardContract, GroupRoutingConfig, MoELayerSpec, MoEModelPreset,
    _raise_unsupported_load_balance_coeff)
from dsrun.utils.logging import logger


class AutoEPPresetAdapter:
    """The default family behaviour; a family's adapter overrides what its models do differently."""

    def validate_compatibility(self, preset_name: str, preset: MoEModelPreset, model_config) -> None:
        """ValueError if the model's ``model_type`` or the installed Transformers does not fit the preset."""
        model_type = getattr(model_config, "model_type", None) if model_config is not None else None
        if model_type is None:
            return
        note = preset.unsupported_hf_model_type_notes.get(model_type)
        if note is not None:
            supported = ", ".join(repr(t) for t in preset.hf_model_types) or "none"
            raise ValueError(f"AutoEP preset '{preset_name}' does not support model_type='{model_type}'. {note} "
                             f"Supported HF model_type value(s): {supported}.")
        self._validate_transformers_version(preset_name, preset, model_type)

    def _validate_transformers_version(self, preset_name: str, preset: MoEModelPreset, model_type: str) -> None:
        minimum = preset.min_transformers_version
        if minimum is None or not self._requires_transformers_version_validation():
            return
        if model_type not in preset.hf_model_types and model_type not in preset.unsupported_hf_model_type_notes:
            return
        what = f"AutoEP preset '{preset_name}' for model_type='{model_type}' requires Transformers >= {minimum}"
        try:
            installed = self._installed_transformers_version()
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's environment
            raise ValueError(f"{what}, but transformers could not be imported: {exc}.") from exc
        try:
            too_old = Version(installed) < Version(minimum)
        except InvalidVersion as exc:
            raise ValueError(f"{what}, but the installed Transformers version '{installed}' could not be "
                             "parsed.") from exc
        if too_old:
            raise ValueError(f"{what}, but installed transformers=={installed}. Upgrade Transformers or choose a "
                             "preset/model combination supported by the installed Transformers version.")

    def _installed_transformers_version(self) -> str:
        import transformers
        return getattr(transformers, "__version__", "unknown")

    def _requires_transformers_version_validation(self) -> bool:
        return False  # the default also serves custom and mock models; HF-only families opt in

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config) -> bool:
        if config.route_norm is not None:
            return config.route_norm
        from_model = getattr(model_config, "norm_topk_prob", None)
        return bool(from_model) if from_model is not None else preset.route_norm

    def resolve_group_routing(self, config: AutoEPConfig, model_config) -> GroupRoutingConfig:
        return GroupRoutingConfig(config.num_expert_groups, config.num_limited_groups)

    def resolve_expert_layout(self, experts_module: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        return preset

    def adjust_forward_contract(self, contract: ForwardContract) -> ForwardContract:
        return contract

    def retarget_transformers_output_recorders(self, model: nn.Module, spec: MoELayerSpec, replacement: nn.Module,
                                               retargeted_keys: set[str],
                                               remove_output_capture_hooks: Callable[[nn.Module], int]) -> None:
        return


def _retarget_transformers_output_recorders_for_modules(
        *, model: nn.Module, display_name: str, recorder_key: str, retargeted_keys: set[str],
        remove_output_capture_hooks: Callable[[nn.Module], int], module_matches: Callable[[nn.Module], bool],
        make_output_recorder: Callable[[Any], Any]) -> int:
    """Point Transformers' ``router_logits`` output recorder of the matching modules at the AutoEP replacement.

    Transformers (>= 5) records router logits by hooks its ``_CAN_RECORD_REGISTRY`` names per model class; after
    the MoE block is replaced the registered class no longer runs, so the entry is rewritten for these model
    instances and the hooks are installed again (the registry is restored afterwards, so other models keep
    theirs). Returns how many modules were retargeted."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return 0
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    if not isinstance(registry, dict):
        return 0
    entries: dict[str, dict[str, Any]] = {}
    for module in model.modules():
        if not module_matches(module):
            continue
        key = str(module.__class__)
        own = getattr(module, "_can_record_outputs", None)
        base = own if isinstance(own, dict) else dict.get(registry, key)
        if not isinstance(base, dict) or "router_logits" not in base:
            continue
        outputs = dict(base, router_logits=make_output_recorder(output_capturing.OutputRecorder))
        module._can_record_outputs = outputs
        entries[key] = outputs
    if not entries:
        logger.warning(f"AutoEP: {display_name} conversion did not find a HF output-capture registry entry for "
                       "router_logits.")
        return 0
    install = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    if callable(install):
        remove_output_capture_hooks(model)
        for module in model.modules():
            if hasattr(module, "_output_capturing_hooks_installed"):
                module._output_capturing_hooks_installed = False
        model._output_capturing_hooks_installed = False
        missing = object()
        # plain dict access by class name: Transformers' registry (a dict subclass) overrides get/[]= to take a
        # model instead of its key in newer releases
        saved = {key: dict.get(registry, key, missing) for key in entries}
        try:
            dict.update(registry, entries)
            install(model)
        finally:
            for key, value in saved.items():
                if value is missing:
                    dict.pop(registry, key, None)
                else:
                    dict.__setitem__(registry, key, value)
        return len(entries)
    if recorder_key not in retargeted_keys:  # older hook API: the registry itself carries the new entry
        retargeted_keys.add(recorder_key)
        dict.update(registry, entries)
        if getattr(model, "_output_capturing_hooks_installed", False):
            remove_output_capture_hooks(model)
        model._output_capturing_hooks_installed = False
    return len(entries)


class TransformersTopLevelRouterLogitsAdapter(AutoEPPresetAdapter):
    """Families whose Transformers model records raw router logits at the model level (Mixtral, Qwen2/3-MoE):
    the replacement keeps the block's tensor return and the recorder is pointed at ``router.gate``."""

    def __init__(self, *, display_name: str, hf_model_types: tuple[str, ...],
                 class_name_fragments: tuple[str, ...]) -> None:
        self.display_name = display_name
        self.hf_model_types = hf_model_types
        self.class_name_fragments = class_name_fragments

    def adjust_forward_contract(self, contract: ForwardContract) -> ForwardContract:
        return replace(contract, return_router_logits=False, capture_target="router", capture_index=0,
                       router_logits_capture_mode="raw")

    def retarget_transformers_output_recorders(self, model, spec, replacement, retargeted_keys,
                                               remove_output_capture_hooks) -> None:
        gate = getattr(getattr(replacement, "router", None), "gate", None)
        if gate is None:
            return

        def matches(module: nn.Module) -> bool:
            model_type = getattr(getattr(module, "config", None), "model_type", None)
            name = module.__class__.__name__
            return model_type in self.hf_model_types or any(f in name for f in self.class_name_fragments)

        cls = replacement.__class__
        _retarget_transformers_output_recorders_for_modules(
            model=model, display_name=self.display_name,
            recorder_key=f"{spec.model_family}:{cls.__module__}.{cls.__qualname__}", retargeted_keys=retargeted_keys,
            remove_output_capture_hooks=remove_output_capture_hooks, module_matches=matches,
            make_output_recorder=lambda recorder: recorder(gate.__class__, index=0, layer_name="router.gate"))


from dsrun.moe.autoep.presets import families  # noqa: E402  (the presets need the adapter classes above)

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
