"""Find a model's MoE blocks and replace them with :class:`~dsrun.autoep.layer.AutoEPMoELayer`
(DeepSpeed's ``module_inject.auto_ep.AutoEP``).

A block is a module whose path matches the preset's ``moe_layer_pattern`` and that has the preset's router and
experts children; its sizes come from the model config and are checked against the weights' shapes (the full
shapes when ZeRO-3 has partitioned them).
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import Literal

import torch
import torch.nn as nn

from dsrun.autoep.config import fill_autoep_config_from_hf
from dsrun.autoep.presets import (apply_config_overrides, get_preset_adapter, preset_name_for_hf_model_type,
                                      resolve_preset_candidates, unsupported_preset_for_hf_model_type)
from dsrun.autoep.repack import classify_fused_gate_up_layout
from dsrun.autoep.spec import AutoEPConfig, ForwardContract, MoELayerSpec, MoEModelPreset
from dsrun.utils.logging import logger
from dsrun.zero.partition_params import is_zero_param


def _remove_transformers_output_capture_hooks(model: nn.Module) -> int:
    """Remove Transformers' output-capturing forward hooks (to install them again after the replacement)."""
    removed = 0
    for module in model.modules():
        hooks = getattr(module, "_forward_hooks", None) or {}
        for hook_id, hook in list(hooks.items()):
            if getattr(hook, "__name__", "") != "output_capturing_hook":
                continue
            del hooks[hook_id]
            for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                getattr(module, extra, {}).pop(hook_id, None)
            removed += 1
    return removed


def _shape(param) -> torch.Size:
    return torch.Size(param.ds_shape) if is_zero_param(param) else torch.Size(param.shape)


def _has_3d_expert_params(module: nn.Module, preset: MoEModelPreset) -> bool:
    param = getattr(module, preset.expert_w1, None)
    return isinstance(param, torch.Tensor) and len(_shape(param)) == 3


def _as_finite_float(value, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{field_name} must be a finite number")
    return float(value)


def _resolve_route_scale(config: AutoEPConfig, model_config) -> float:
    """The one scale the router applies: ``routed_scaling_factor`` if set, else the model config's, else
    ``route_scale``."""
    if config.routed_scaling_factor != "auto":
        return _as_finite_float(config.routed_scaling_factor, "routed_scaling_factor")
    from_model = getattr(model_config, "routed_scaling_factor", None)
    if from_model is not None:
        return _as_finite_float(from_model, "model.config.routed_scaling_factor")
    return _as_finite_float(config.route_scale, "route_scale")


def _detect_expert_storage(experts: nn.Module, preset: MoEModelPreset) -> Literal["fused_3d", "module_list"]:
    if _has_3d_expert_params(experts, preset):
        return "fused_3d"
    if isinstance(experts, nn.ModuleList):
        return "module_list"
    if any(len(_shape(p)) == 3 for p in experts.parameters(recurse=False)):
        return "fused_3d"
    return "module_list"


def _infer_hidden_and_ffn_size(experts: nn.Module, preset: MoEModelPreset, storage: str) -> tuple[int, int]:
    if storage == "fused_3d":
        w1, w2 = getattr(experts, preset.expert_w1, None), getattr(experts, preset.expert_w2, None)
        if w1 is not None and w2 is not None:
            if preset.expert_w3 is None:
                layout = classify_fused_gate_up_layout(tuple(_shape(w1)), tuple(_shape(w2)))
                if layout is None:
                    raise ValueError("expert_w3=None expects fused gate+up weights with either [E, 2*ffn, hidden]/"
                                     "[E, hidden, ffn] or [E, hidden, 2*ffn]/[E, ffn, hidden], but got "
                                     f"{preset.expert_w1}={tuple(_shape(w1))} and {preset.expert_w2}="
                                     f"{tuple(_shape(w2))}.")
                return layout.hidden_size, layout.ffn_hidden_size
            if getattr(experts, preset.expert_w3, None) is None:
                raise ValueError(f"expert_w3='{preset.expert_w3}' is set but no such weight exists on experts module.")
            return _shape(w1)[2], _shape(w1)[1]
    elif isinstance(experts, nn.ModuleList) and len(experts):
        w1 = getattr(experts[0], preset.expert_w1, None)
        if isinstance(w1, nn.Linear):
            return w1.in_features, w1.out_features
        if w1 is not None and hasattr(w1, "weight"):
            w1 = w1.weight
        if isinstance(w1, torch.Tensor) and len(_shape(w1)) == 2:
            return _shape(w1)[1], _shape(w1)[0]
    raise ValueError(f"Could not infer hidden_size/ffn_hidden_size from experts module with storage={storage}, "
                     f"preset.expert_w1={preset.expert_w1}")


def _detect_forward_contract(moe_module: nn.Module, router_module: nn.Module) -> ForwardContract:
    """How the original block hands its router logits to Transformers' output recorder, if it does."""
    target, index, layer_name, returns_logits = "none", None, None, False
    record = getattr(type(router_module), "_can_record_outputs", None)
    if hasattr(type(router_module), "_can_record_outputs"):
        target, index = "router", 0
        if isinstance(record, dict):
            for value in record.values():
                if isinstance(value, dict):
                    index, layer_name = value.get("index", 0), value.get("layer_name")
    record = getattr(moe_module, "_can_record_outputs", None)
    if record:
        target, returns_logits = "moe_block", True
        if isinstance(record, dict):
            for value in record.values():
                if isinstance(value, dict):
                    index = value.get("index")
                elif isinstance(value, int):
                    index = value
    return ForwardContract(return_router_logits=returns_logits, capture_target=target, capture_index=index,
                           capture_layer_name=layer_name)


class AutoEP:
    """Detect (:meth:`ep_parser`) and replace (:meth:`replace_moe_layer`) a model's MoE blocks."""

    def __init__(self, model: nn.Module, config: AutoEPConfig) -> None:
        self.model = model
        self.config = config
        self.model_config = getattr(model, "config", None)
        self._retargeted_transformers_output_recorders: set[str] = set()
        fill_autoep_config_from_hf(self.config, self.model_config)

    def _resolve_presets(self) -> list[tuple[str, MoEModelPreset]]:
        return resolve_preset_candidates(self.config, self.model_config)

    def _apply_config_overrides(self, preset: MoEModelPreset) -> MoEModelPreset:
        return apply_config_overrides(self.config, preset)

    def ep_parser(self) -> list[MoELayerSpec]:
        """One :class:`MoELayerSpec` per MoE block found (ValueError when a chosen preset finds none)."""
        presets = self._resolve_presets()
        specs = []
        for preset_name, preset in presets:
            pattern = re.compile(preset.moe_layer_pattern)
            for name, module in self.model.named_modules():
                if pattern.fullmatch(name):
                    spec = self._layer_spec(preset_name, preset, name, module)
                    if spec is not None:
                        specs.append(spec)
        if not specs:
            if self._requires_selected_preset_detection():
                self._raise_no_moe_layers_detected(presets)
            logger.warning("AutoEP: no MoE layers detected in model.")
            return specs
        by_module: dict[str, list[str]] = {}
        for spec in specs:
            by_module.setdefault(spec.moe_module_name, []).append(spec.model_family)
        ambiguous = {name: fams for name, fams in by_module.items() if len(fams) > 1}
        if ambiguous:
            details = "; ".join(f"{n}: {', '.join(f)}" for n, f in sorted(ambiguous.items()))
            raise ValueError("AutoEP detection is ambiguous and produced multiple replacement specs for the same MoE "
                             f"module(s): {details}. Set expert_parallel.preset_model or provide custom AutoEP "
                             "patterns so each MoE module matches exactly one preset.")
        return specs

    def _layer_spec(self, preset_name: str, preset: MoEModelPreset, name: str,
                    module: nn.Module) -> MoELayerSpec | None:
        adapter = get_preset_adapter(preset.preset_adapter)
        experts = getattr(module, preset.experts_pattern, None)
        if experts is None:
            return None  # a dense MLP at a matching path
        layout = adapter.resolve_expert_layout(experts, preset)
        router = getattr(module, preset.router_pattern, None)
        if not (isinstance(experts, nn.ModuleList) or _has_3d_expert_params(experts, layout)) or router is None:
            return None
        storage = _detect_expert_storage(experts, layout)
        cfg = self.model_config
        num_experts = getattr(cfg, preset.num_experts_attr, None) if cfg is not None else None
        top_k = getattr(cfg, preset.top_k_attr, None) if cfg is not None else None
        router_weight = getattr(router, "weight", None)
        router_shape = _shape(router_weight) if router_weight is not None else None
        if router_shape is not None and len(router_shape) == 2:
            if num_experts is not None and num_experts != router_shape[0]:
                raise ValueError(f"Config num_experts={num_experts} mismatches router weight shape {router_shape} "
                                 f"(expected {router_shape[0]}) in layer '{name}'")
            num_experts = router_shape[0]
        if num_experts is None:
            raise ValueError(f"Could not determine num_experts for layer '{name}'. Set "
                             f"model.config.{preset.num_experts_attr} or use a preset.")
        if isinstance(self.config.top_k, int):
            top_k = self.config.top_k
        elif top_k is None:
            raise ValueError(f"Could not determine top_k for layer '{name}'. Set model.config.{preset.top_k_attr} "
                             "or config top_k.")
        try:
            hidden, ffn = _infer_hidden_and_ffn_size(experts, layout, storage)
        except ValueError as exc:
            if self._requires_selected_preset_detection():
                raise ValueError(f"AutoEP: preset '{preset_name}' matched layer '{name}' with router and experts, "
                                 f"but shape inference failed: {exc}") from exc
            logger.warning(f"Skipping {name}: {exc}")
            return None
        if router_shape is not None and len(router_shape) == 2 and hidden != router_shape[1]:
            raise ValueError(f"hidden_size={hidden} from expert weights mismatches router weight dim={router_shape[1]} "
                             f"in '{name}'")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts} in layer '{name}'")
        score_func = self.config.score_func
        if score_func == "auto":
            score_func = getattr(cfg, "scoring_func", None)
            score_func = score_func if score_func in ("softmax", "sigmoid") else preset.score_func
        score_apply = preset.score_apply if self.config.score_apply == "auto" else self.config.score_apply
        group_routing = adapter.resolve_group_routing(self.config, cfg)
        contract = adapter.adjust_forward_contract(_detect_forward_contract(module, router))
        shared_name = shared_gate_name = ""
        if preset.has_shared_experts and preset.shared_experts_pattern and \
                getattr(module, preset.shared_experts_pattern, None) is not None:
            shared_name = preset.shared_experts_pattern
            if preset.shared_experts_gate_pattern and getattr(module, preset.shared_experts_gate_pattern, None) is not None:
                shared_gate_name = preset.shared_experts_gate_pattern
        for attr, what in (("router_jitter_noise", "jitter"), ("router_z_loss_coef", "z-loss")):
            if cfg is not None and (getattr(cfg, attr, 0.0) or 0.0) > 0:
                logger.warning(f"Layer {name}: model has {attr}={getattr(cfg, attr)}, AutoEP router does not "
                               f"implement {what}.")
        return MoELayerSpec(
            moe_module_name=name, model_family=preset_name, router_name=preset.router_pattern,
            experts_name=preset.experts_pattern, expert_storage=storage, expert_w1_name=layout.expert_w1,
            expert_w2_name=layout.expert_w2, expert_w3_name=layout.expert_w3, num_experts=num_experts, top_k=top_k,
            hidden_size=hidden, ffn_hidden_size=ffn, score_func=score_func, score_apply=score_apply,
            route_norm=adapter.resolve_route_norm(self.config, preset, cfg),
            gate_bias=getattr(router, "bias", None) is not None if router_weight is not None else preset.gate_bias,
            return_router_logits=contract.return_router_logits, router_logits_capture_target=contract.capture_target,
            router_logits_capture_index=contract.capture_index,
            router_logits_capture_layer_name=contract.capture_layer_name, has_shared_experts=bool(shared_name),
            shared_experts_name=shared_name, shared_experts_gate_name=shared_gate_name,
            route_scale=_resolve_route_scale(self.config, cfg), num_expert_groups=group_routing.num_expert_groups,
            num_limited_groups=group_routing.num_limited_groups, group_score_func=group_routing.group_score_func,
            supports_expert_bias=preset.supports_expert_bias,
            unsupported_router_bias_names=preset.unsupported_router_bias_names, preset_adapter=preset.preset_adapter,
            router_logits_capture_mode=contract.router_logits_capture_mode, moe_output_shape=contract.moe_output_shape)

    def _replace_moe_layer_without_retarget(self, spec: MoELayerSpec, ep_size: int, ep_rank: int) -> nn.Module:
        from dsrun.autoep.layer import AutoEPMoELayer

        parent_name, _, child = spec.moe_module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        replacement = AutoEPMoELayer(spec=spec, source_module=getattr(parent, child), ep_size=ep_size,
                                     ep_rank=ep_rank, config=self.config)
        setattr(parent, child, replacement)
        logger.info(f"AutoEP: replaced '{spec.moe_module_name}' with AutoEPMoELayer (ep_size={ep_size}, "
                    f"ep_rank={ep_rank}, local_experts={replacement.num_local_experts})")
        return replacement

    def _retarget_transformers_output_recorders(self, spec: MoELayerSpec, replacement: nn.Module) -> None:
        get_preset_adapter(spec.preset_adapter).retarget_transformers_output_recorders(
            self.model, spec, replacement, self._retargeted_transformers_output_recorders,
            _remove_transformers_output_capture_hooks)

    def replace_moe_layer(self, spec: MoELayerSpec, ep_size: int, ep_rank: int) -> None:
        """Replace one block in place on the model."""
        self._retarget_transformers_output_recorders(spec, self._replace_moe_layer_without_retarget(
            spec, ep_size, ep_rank))

    def replace_moe_layers(self, specs: list[MoELayerSpec], ep_size: int, ep_rank: int) -> None:
        """Replace every block, then retarget Transformers' recorders once per (family, layer class)."""
        first_of_kind: OrderedDict[tuple, tuple[MoELayerSpec, nn.Module]] = OrderedDict()
        for spec in specs:
            replacement = self._replace_moe_layer_without_retarget(spec, ep_size, ep_rank)
            first_of_kind.setdefault((spec.preset_adapter, spec.model_family, type(replacement)), (spec, replacement))
        for spec, replacement in first_of_kind.values():
            self._retarget_transformers_output_recorders(spec, replacement)

    def _requires_selected_preset_detection(self) -> bool:
        """Whether finding no block is an error: a preset or pattern was named, or the model type is one AutoEP
        knows."""
        if self.config.preset_model is not None or self.config.moe_layer_pattern is not None:
            return True
        model_type = getattr(self.model_config, "model_type", None)
        return model_type is not None and (preset_name_for_hf_model_type(model_type) is not None
                                           or unsupported_preset_for_hf_model_type(model_type) is not None)

    def _raise_no_moe_layers_detected(self, presets: list[tuple[str, MoEModelPreset]]) -> None:
        if self.config.preset_model is not None:
            source = f"preset_model='{self.config.preset_model}'"
        elif self.config.moe_layer_pattern is not None:
            source = f"moe_layer_pattern='{self.config.moe_layer_pattern}'"
        else:
            source = f"model_type='{getattr(self.model_config, 'model_type', None)}'"
        expected = "; ".join(f"{n}: moe_layer_pattern='{p.moe_layer_pattern}', router='{p.router_pattern}', "
                             f"experts='{p.experts_pattern}'" for n, p in presets)
        raise ValueError(f"AutoEP: no MoE layers detected for {source}. Expected MoE structure for selected "
                         f"preset(s): {expected}. Choose a matching preset, upgrade Transformers, or provide custom "
                         "AutoEP patterns.")
