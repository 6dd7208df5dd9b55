"""The preset adapters: what a model family does differently beyond its names (route normalisation, group-limited
routing, its expert layout, how Transformers records its router logits)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch.nn as nn
from packaging.version import InvalidVersion, Version

from dsrun.autoep.spec import AutoEPConfig, ForwardContract, GroupRoutingConfig, MoELayerSpec, MoEModelPreset
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
