"""The ``expert_parallel`` config section: parse it, check it against the run's sizes, check it against the
detected layers, and fill what the Hugging Face model config says (DeepSpeed's ``auto_ep_config``)."""
from __future__ import annotations

from dsrun.autoep.folding import build_folding_spec, validate_folding_global
from dsrun.autoep.presets import PRESET_MODELS, available_preset_names, resolve_autoep_config_defaults
from dsrun.autoep.spec import _UNSET, AutoEPConfig, MoELayerSpec, MoEModelPreset
from dsrun.config.expert_parallel import AUTOEP_KEYS, _raise_unsupported_load_balance_coeff, parse_autoep_config
from dsrun.utils.logging import logger

__all__ = ["_UNSET", "AutoEPConfig", "MoELayerSpec", "MoEModelPreset", "PRESET_MODELS", "parse_autoep_config",
           "resolve_autoep_config_defaults", "validate_autoep_config", "validate_autoep_post_detection",
           "fill_autoep_config_from_hf", "AUTOEP_KEYS"]


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got '{value}'")


def _check_attr_name(name: str, value) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if "." in value:
        raise ValueError(f"{name} must be a direct attribute name (no dots)")


def validate_autoep_config(config: AutoEPConfig, world_size: int, pp_size: int, tp_size: int, sp_size: int, *,
                           zero_stage: int = 0, deepcompile_enabled: bool = False, tp_preset_model: str | None = None,
                           use_data_before_expert_parallel: bool = False, mpu=None,
                           zero_offload_optimizer: bool = False, zero_offload_param: bool = False) -> None:
    """ValueError naming the first setting that does not fit the run (sizes, topology, names, choices)."""
    if config.load_balance_coeff is not None:
        _raise_unsupported_load_balance_coeff(config.load_balance_coeff)
    if not isinstance(config.validate_folding_routing, bool):
        raise ValueError("expert_parallel.validate_folding_routing must be a boolean")
    if not config.enabled:
        return
    spec = build_folding_spec(world_size=world_size, pp_size=pp_size, tp_size=max(tp_size, 1),
                              ep_size=config.autoep_size, etp_size=config.expert_tensor_parallel_size,
                              mp_mode="tp" if tp_size > 1 else "sp")
    validate_folding_global(spec, zero_stage=zero_stage, sp_size=sp_size, deepcompile_enabled=deepcompile_enabled,
                            use_data_before_expert_parallel=use_data_before_expert_parallel, mpu=mpu,
                            autoep_enabled=True, tp_preset=tp_preset_model, ep_preset=config.preset_model,
                            zero_offload_optimizer=zero_offload_optimizer, zero_offload_param=zero_offload_param)
    if config.preset_model is not None and config.preset_model not in PRESET_MODELS:
        raise ValueError(f"Unknown preset_model '{config.preset_model}'. "
                         f"Available presets: {list(available_preset_names())}")
    _check_choice("score_apply", config.score_apply, ("auto", "pre", "post"))
    _check_choice("combine_impl", config.combine_impl, ("auto", "weighted_sum", "legacy_bmm"))
    _check_choice("score_func", config.score_func, ("auto", "softmax", "sigmoid"))
    if config.num_limited_groups is not None and config.num_limited_groups < 1:
        raise ValueError(f"num_limited_groups must be >= 1, got {config.num_limited_groups}")
    if config.num_expert_groups is not None:
        if config.num_expert_groups < 1:
            raise ValueError(f"num_expert_groups must be >= 1, got {config.num_expert_groups}")
        if config.num_limited_groups is not None and config.num_limited_groups > config.num_expert_groups:
            raise ValueError(f"num_limited_groups ({config.num_limited_groups}) must be <= num_expert_groups "
                             f"({config.num_expert_groups})")
    if config.autoep_size == 1:
        logger.info("AutoEP: autoep_size=1: every rank owns all experts, layers are replaced, no all-to-all runs.")
    for name in ("expert_w1", "expert_w2", "num_experts_attr", "top_k_attr", "router_pattern", "expert_pattern",
                 "shared_experts_pattern", "shared_experts_gate_pattern"):
        _check_attr_name(name, getattr(config, name))
    if config.expert_w3 is not _UNSET:
        _check_attr_name("expert_w3", config.expert_w3)
    if config.has_shared_experts is not None and not isinstance(config.has_shared_experts, bool):
        raise ValueError("has_shared_experts must be a boolean when set")
    if config.routed_scaling_factor != "auto" and not isinstance(config.routed_scaling_factor, (int, float)):
        raise ValueError("routed_scaling_factor must be a number or 'auto'")
    if config.shared_experts_pattern and config.has_shared_experts is not True:
        logger.warning(f"AutoEP: shared_experts_pattern='{config.shared_experts_pattern}' is set but "
                       "has_shared_experts is not True: the pattern is not used.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_autoep_post_detection(config: AutoEPConfig, specs: list[MoELayerSpec]) -> None:
    """ValueError if ``autoep_size`` or the group-limited routing does not fit a detected layer's experts."""
    if not config.enabled:
        return
    ep = config.autoep_size
    for spec in specs:
        where = f"layer '{spec.moe_module_name}'"
        if ep > spec.num_experts:
            raise ValueError(f"autoep_size={ep} exceeds num_experts={spec.num_experts} in {where}. Each rank must "
                             f"own at least one expert. Valid autoep_size values (divisors of {spec.num_experts}): "
                             f"{_divisors(spec.num_experts)}")
        if spec.num_experts % ep:
            raise ValueError(f"num_experts={spec.num_experts} in {where} is not divisible by autoep_size={ep}. "
                             f"Suggested autoep_size values: {_divisors(spec.num_experts)}")
        groups = spec.num_expert_groups if spec.num_expert_groups is not None else config.num_expert_groups
        limited = spec.num_limited_groups if spec.num_limited_groups is not None else config.num_limited_groups
        if limited is not None and groups is None:
            raise ValueError(f"num_limited_groups requires num_expert_groups to be set in {where}")
        if groups is None:
            continue
        if groups < 1:
            raise ValueError(f"num_expert_groups must be >= 1 in {where}, got {groups}")
        if spec.num_experts % groups:
            raise ValueError(f"num_expert_groups ({groups}) must divide num_experts ({spec.num_experts}) in {where}")
        if limited is None:
            raise ValueError(f"num_limited_groups must be set when num_expert_groups is set in {where}")
        if limited < 1:
            raise ValueError(f"num_limited_groups must be >= 1 in {where}, got {limited}")
        if limited > groups:
            raise ValueError(f"num_limited_groups ({limited}) must be <= num_expert_groups ({groups}) in {where}")


def fill_autoep_config_from_hf(config: AutoEPConfig, model_config) -> None:
    """Take DeepSeek's ``n_group``/``topk_group``/``routed_scaling_factor`` from the model config where the user
    set nothing (their AutoEP names differ: ``num_expert_groups``, ``num_limited_groups``, ``route_scale``)."""
    if model_config is None:
        return
    if config.num_expert_groups is None:
        config.num_expert_groups = getattr(model_config, "n_group", None)
    if config.num_limited_groups is None:
        config.num_limited_groups = getattr(model_config, "topk_group", None)
    if config.routed_scaling_factor == "auto" and getattr(model_config, "routed_scaling_factor", None) is not None:
        config.route_scale = float(model_config.routed_scaling_factor)
