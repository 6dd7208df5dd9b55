"""The ``expert_parallel`` config section (DeepSpeed's AutoEP, ``deepspeed.module_inject.auto_ep_config``'s
``AutoEPConfig`` and its parsing): the typed section the config layer reads (``DeepSpeedConfig.expert_parallel_config``)
and AutoEP (:mod:`dsrun.autoep`) builds its layers from. Checking it against the run's sizes and the detected layers
is AutoEP's (:mod:`dsrun.autoep.config`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NoReturn

# "not set in the config: use the preset's value" (None means something: expert_w3=None is a fused gate+up)
_UNSET = object()


def _raise_unsupported_load_balance_coeff(value: object) -> NoReturn:
    raise ValueError(f"load_balance_coeff={value!r} is not supported in this AutoEP build (would register "
                     "expert_bias and route through unsupported auxiliary-loss-free load balancing). Set "
                     "load_balance_coeff to null or omit the key.")


@dataclass
class AutoEPConfig:
    """The ``expert_parallel`` config section (docs/moe.md lists each key)."""

    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum", "legacy_bmm"] = "auto"
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: int | str = "auto"
    load_balance_coeff: float | None | object = _UNSET
    routed_scaling_factor: float | str = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: object = _UNSET
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    _load_balance_coeff_explicit: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._load_balance_coeff_explicit = self.load_balance_coeff is not _UNSET
        if self.load_balance_coeff is _UNSET:
            self.load_balance_coeff = None


# key -> default, in the order docs/moe.md lists them (expert_w3 and load_balance_coeff are read apart)
_DEFAULTS = {"enabled": False, "autoep_size": 1, "expert_tensor_parallel_size": 1, "validate_folding_routing": False,
             "preset_model": None, "moe_layer_pattern": None, "expert_pattern": None, "router_pattern": None,
             "use_grouped_mm": True, "disable_triton_grouped_mm": False, "route_norm": None, "route_scale": 1.0,
             "score_apply": "auto", "combine_impl": "auto", "num_expert_groups": None, "num_limited_groups": None,
             "score_func": "auto", "top_k": "auto", "routed_scaling_factor": "auto", "expert_w1": None,
             "expert_w2": None, "num_experts_attr": None, "top_k_attr": None, "has_shared_experts": None,
             "shared_experts_pattern": None, "shared_experts_gate_pattern": None}
AUTOEP_KEYS = tuple(_DEFAULTS) + ("expert_w3", "load_balance_coeff")


def parse_autoep_config(param_dict: dict) -> AutoEPConfig:
    """An :class:`AutoEPConfig` from the ``expert_parallel`` dict (absent keys take their defaults)."""
    config = AutoEPConfig()
    if not param_dict:
        return config
    for key, default in _DEFAULTS.items():
        setattr(config, key, param_dict.get(key, default))
    # absent: the preset's name; null: gate and up are fused in w1; a string: that attribute
    config.expert_w3 = param_dict["expert_w3"] if "expert_w3" in param_dict else _UNSET
    if "load_balance_coeff" in param_dict and param_dict["load_balance_coeff"] is not None:
        _raise_unsupported_load_balance_coeff(param_dict["load_balance_coeff"])
    config.load_balance_coeff = None
    config._load_balance_coeff_explicit = "load_balance_coeff" in param_dict
    return config
