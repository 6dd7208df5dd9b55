"""DeepSpeed's configurable AutoTP (``tensor_parallel.partition_config``, ``tensor_parallel.preset_model``;
``deepspeed.module_inject.autotp_config``): which linears are split, and how, named by regular expressions.

A :class:`TPLayerSpec` names parameters by pattern (``re.match`` on the parameter's name in the model,
``model.layers.0.self_attn.q_proj.weight``) and says how their linear is split: ``column`` (its output features:
each rank computes its slice of the output from the whole input), ``row`` (its input features: the partial outputs
are summed over the group) or ``skip`` (whole on every rank; ``grad_allreduce`` sums its gradient over the group,
for a parameter that each rank's heads use a part of). ``shape`` views a fused weight as sub-parameters along the
split dimension (``[3, -1]``: q|k|v, each part split on its own); ``gather_output`` all-gathers a column-parallel
output so every rank holds the whole (an untied LM head). An :class:`AutoTPConfig` is the list of specs (the first
match wins) and its flags: ``strict_mode`` refuses a linear no spec matches (else it stays whole),
``use_default_specs`` merges a ``preset_model``'s specs after the custom ones. :class:`AutoTPPresets` holds
DeepSpeed's presets, by model family. The split itself is :func:`dsrun.tensor_parallel.spec_split.split_by_specs`.

The names and meanings are DeepSpeed's (``deepspeed/module_inject/autotp_config.py``); unlike DeepSpeed, a key
``from_dict`` does not know is refused rather than ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Optional, Union

from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.suggest import did_you_mean

ShapeEntry = Union[int, tuple[int, ...]]


class PartitionType(Enum):
    """How a linear is split: its output features (``column``), its input features (``row``), or not (``skip``)."""

    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


def _partition_type(value: object) -> PartitionType:
    if isinstance(value, PartitionType):
        return value
    names = [t.value for t in PartitionType]
    if isinstance(value, str) and value.lower() in names:
        return PartitionType(value.lower())
    raise ConfigError(Problem("partition_type", f"got {value!r}; one of {names}"))


def _tuple_shape(shape: object) -> object:
    """A JSON shape (lists) as DeepSpeed's tuples, one level of nesting kept."""
    if isinstance(shape, list):
        shape = tuple(shape)
    if isinstance(shape, tuple):
        return tuple(tuple(item) if isinstance(item, list) else item for item in shape)
    return shape


@dataclass
class TPLayerSpec:
    """One rule: the parameters ``patterns`` match (``re.match``; ``model_types`` limits it to those models' own
    ``config.model_type``) are split as ``partition_type`` says. ``shape`` is the weight's logical shape
    ``(out, in)`` with ``-1`` for a dimension to infer; at ``partition_dim`` (0 for a column, 1 for a row split by
    default) an int ``n`` makes ``n`` equal fused sub-parameters, a tuple their sizes."""

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Optional[tuple[ShapeEntry, ...]] = None
    partition_dim: Optional[int] = None
    model_types: Optional[list[str]] = None
    gather_output: bool = False
    grad_allreduce: bool = False

    def __post_init__(self) -> None:
        self.partition_type = _partition_type(self.partition_type)
        if isinstance(self.patterns, str) or not all(isinstance(p, str) for p in self.patterns):
            raise ConfigError(Problem("patterns", f"got {self.patterns!r}; a list of regular expressions"))
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(Problem("patterns", f"{pattern!r} is not a regular expression ({err})")) from None
        if self.shape is not None:
            self.shape = _tuple_shape(self.shape)
            self._check_shape()
        if self.grad_allreduce and self.partition_type is not PartitionType.SKIP:
            raise ConfigError(Problem("grad_allreduce", "applies to skip specs only (a replicated parameter whose "
                                      "gradient is summed over the group)"))

    def _check_shape(self) -> None:
        shape, dim = self.shape, self.get_partition_dim()
        if not isinstance(shape, tuple) or not shape:
            raise ConfigError(Problem("shape", f"got {shape!r}; a list of ints (-1 infers one)"))
        if not 0 <= dim < len(shape):
            raise ConfigError(Problem("partition_dim", f"{dim} is outside shape {list(shape)}"))
        for index, entry in enumerate(shape):
            if isinstance(entry, tuple):
                if index != dim:
                    raise ConfigError(Problem("shape", f"nested tuple only allowed at partition_dim={dim} "
                                              f"(sub-parameter sizes), not at {index}"))
                if not entry or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in entry):
                    raise ConfigError(Problem("shape", f"sub-parameter sizes {list(entry)} must be positive ints "
                                              "(one level of nesting)"))
            elif not isinstance(entry, int) or isinstance(entry, bool) or entry == 0 or entry < -1:
                raise ConfigError(Problem("shape", f"entry {entry!r}: a positive int or -1"))

    def get_partition_dim(self) -> int:
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type is PartitionType.COLUMN else 1

    def has_unequal_sub_params(self) -> bool:
        return self.get_sub_param_sizes() is not None

    def get_sub_param_sizes(self) -> Optional[tuple[int, ...]]:
        """The sizes given at ``partition_dim`` (a nested tuple), else None."""
        dim = self.get_partition_dim()
        if self.shape is None or dim >= len(self.shape) or not isinstance(self.shape[dim], tuple):
            return None
        return self.shape[dim]  # type: ignore[return-value]

    def get_num_sub_params(self) -> Optional[int]:
        """How many fused sub-parameters the shape names at ``partition_dim`` (None: not said)."""
        dim = self.get_partition_dim()
        if self.shape is None or dim >= len(self.shape):
            return None
        entry = self.shape[dim]
        if isinstance(entry, tuple):
            return len(entry)
        return entry if entry > 0 else None

    def matches(self, param_name: str, model_type: Optional[str] = None) -> bool:
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {str(m).lower() for m in self.model_types}:
                return False
        return any(re.match(pattern, param_name) for pattern in self.patterns)


_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output",
              "grad_allreduce")
_CONFIG_KEYS = ("tp_size", "layer_specs", "embedding_partition_dim", "lm_head_patterns", "use_default_specs",
                "strict_mode")


def _unknown(keys: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in keys:
        if key not in known:
            raise ConfigError(Problem(f"{where}.{key}", "is not a key of DeepSpeed's partition_config",
                                      did_you_mean(str(key), known)))


@dataclass
class AutoTPConfig:
    """The rules of a configurable AutoTP split (DeepSpeed's names; ``embedding_partition_dim`` and
    ``lm_head_patterns`` are kept for its API and, as in DeepSpeed's training path, not read by the split)."""

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def find_matching_spec(self, param_name: str, model_type: Optional[str] = None) -> Optional[TPLayerSpec]:
        """The first spec matching ``param_name`` (DeepSpeed warns when several do; the first wins)."""
        return next((spec for spec in self.layer_specs if spec.matches(param_name, model_type)), None)

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> "AutoTPConfig":
        """The config from its JSON form (``tensor_parallel.partition_config``); an unknown key or a bad value is
        a ConfigError naming it."""
        if not isinstance(config_dict, Mapping):
            raise ConfigError(Problem("partition_config", f"got {config_dict!r}; a mapping"))
        _unknown(config_dict, _CONFIG_KEYS, "partition_config")
        raw_specs = config_dict.get("layer_specs", [])
        if not isinstance(raw_specs, list):
            raise ConfigError(Problem("partition_config.layer_specs", f"got {raw_specs!r}; a list of specs"))
        specs = []
        for index, raw in enumerate(raw_specs):
            where = f"partition_config.layer_specs[{index}]"
            if not isinstance(raw, Mapping) or "patterns" not in raw:
                raise ConfigError(Problem(where, f"got {raw!r}; a mapping with 'patterns'"))
            _unknown(raw, _SPEC_KEYS, where)
            try:
                specs.append(TPLayerSpec(**{k: raw[k] for k in _SPEC_KEYS if k in raw}))
            except ConfigError as err:
                problem = err.problems[0]
                raise ConfigError(Problem(f"{where}.{problem.path}", problem.message, problem.hint)) from None
        values = {key: config_dict[key] for key in _CONFIG_KEYS if key in config_dict and key != "layer_specs"}
        return cls(layer_specs=specs, **values)


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """``override``'s specs first (they match first), then ``base``'s; ``override``'s flags."""
    return AutoTPConfig(tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
                        layer_specs=[*override.layer_specs, *base.layer_specs],
                        embedding_partition_dim=override.embedding_partition_dim,
                        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
                        use_default_specs=override.use_default_specs, strict_mode=override.strict_mode)


# ------------------------------------------------------------------------------------------------ presets
def _rules(*rules: tuple[str, str, dict[str, Any]]) -> AutoTPConfig:
    return AutoTPConfig(layer_specs=[TPLayerSpec(patterns=[rf".*\.{pattern}\.weight$"], partition_type=kind, **extra)
                                     for pattern, kind, extra in rules])


def _attention(q: str = r"self_attn\.[qkv]_proj", o: str = r"self_attn\.o_proj", **q_extra: object
               ) -> list[tuple[str, str, dict[str, Any]]]:
    return [(o, "row", {}), (q, "column", q_extra)]


_GATED_MLP = [(r"mlp\.down_proj", "row", {}), (r"mlp\.(up|gate)_proj", "column", {})]


class AutoTPPresets:
    """DeepSpeed's built-in rules for common model families (``tensor_parallel.preset_model``)."""

    @staticmethod
    def llama() -> AutoTPConfig:
        return _rules(*_attention(), *_GATED_MLP)

    @staticmethod
    def qwen2() -> AutoTPConfig:
        return _rules(*_attention(), *_GATED_MLP)

    @staticmethod
    def llama_gqa(num_heads: int, num_kv_heads: int, head_dim: int) -> AutoTPConfig:
        """A fused ``qkv_proj`` whose q, k and v widths differ (grouped-query attention)."""
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        return _rules(*_attention(q=r"self_attn\.qkv_proj", shape=((q, kv, kv), -1), partition_dim=0), *_GATED_MLP)

    @staticmethod
    def bloom() -> AutoTPConfig:
        # BLOOM interleaves q, k, v per head: a plain column split keeps whole heads
        return _rules(*_attention(q=r"self_attention\.query_key_value", o=r"self_attention\.dense"),
                      (r"mlp\.dense_4h_to_h", "row", {}), (r"mlp\.dense_h_to_4h", "column", {}))

    @staticmethod
    def chatglm() -> AutoTPConfig:
        return _rules(*_attention(q=r"self_attention\.query_key_value", o=r"self_attention\.dense", shape=(3, -1),
                                  partition_dim=0),
                      (r"mlp\.dense_4h_to_h", "row", {}),
                      (r"mlp\.dense_h_to_4h", "column", {"shape": (2, -1), "partition_dim": 0}))

    @staticmethod
    def mixtral() -> AutoTPConfig:
        experts = r"block_sparse_moe\.experts\.\d+"
        return _rules(*_attention(), (rf"{experts}\.w2", "row", {}), (rf"{experts}\.w[13]", "column", {}),
                      (r"block_sparse_moe\.gate", "skip", {}))

    @staticmethod
    def deepseek_v2() -> AutoTPConfig:
        return _rules((r"self_attn\.o_proj", "row", {}), (r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)", "skip", {}),
                      (r"self_attn\.(q_b_proj|kv_b_proj)", "column", {}),
                      (r"mlp\.experts\.\d+\.down_proj", "row", {}), (r"mlp\.experts\.\d+\.(up|gate)_proj", "column", {}),
                      (r"mlp\.gate", "skip", {}), (r"mlp\.shared_experts\.down_proj", "row", {}),
                      (r"mlp\.shared_experts\.(up|gate)_proj", "column", {}))

    @staticmethod
    def phi3() -> AutoTPConfig:
        return _rules(*_attention(q=r"self_attn\.qkv_proj", shape=(3, -1), partition_dim=0),
                      (r"mlp\.down_proj", "row", {}), (r"mlp\.gate_up_proj", "column", {"shape": (2, -1),
                                                                                       "partition_dim": 0}))

    @staticmethod
    def get_preset(model_type: str) -> Optional[AutoTPConfig]:
        """The preset of ``model_type`` (case-insensitive), None when there is none."""
        build = PRESETS.get(str(model_type).lower())
        return build() if build else None


PRESETS: dict[str, Callable[[], AutoTPConfig]] = {
    "llama": AutoTPPresets.llama, "bloom": AutoTPPresets.bloom, "chatglm": AutoTPPresets.chatglm,
    "mixtral": AutoTPPresets.mixtral, "deepseek_v2": AutoTPPresets.deepseek_v2, "qwen2": AutoTPPresets.qwen2,
    "phi3": AutoTPPresets.phi3}


def partition_config_object(partition_config: Mapping[str, Any] | None, preset_model: str | None,
                            tp_size: int) -> AutoTPConfig | None:
    """DeepSpeed's ``TPTrainingConfig.get_partition_config_object``: the preset's rules, the custom rules (first,
    merged with the preset's when ``use_default_specs``, else alone), or None when neither is set. Errors name
    the ``tensor_parallel`` key."""
    config = None
    if preset_model is not None:
        config = AutoTPPresets.get_preset(preset_model)
        if config is None:
            raise ConfigError(Problem("tensor_parallel.preset_model", f"got {preset_model!r}; one of "
                                      f"{sorted(PRESETS)}", did_you_mean(str(preset_model), sorted(PRESETS))))
    if partition_config is not None:
        try:
            custom = AutoTPConfig.from_dict(partition_config)
        except ConfigError as err:
            problem = err.problems[0]
            raise ConfigError(Problem(f"tensor_parallel.{problem.path}", problem.message, problem.hint)) from None
        config = merge_autotp_configs(config, custom) if config is not None and custom.use_default_specs else custom
    if config is not None:
        config.tp_size = tp_size
    return config
