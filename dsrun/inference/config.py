"""``DeepSpeedInferenceConfig``: the settings of :func:`dsrun.init_inference`, DeepSpeed's names and aliases.

``init_inference(model, config=None, **kwargs)`` accepts a dict (or the path of a JSON file) and keyword
arguments; all four combinations are valid. A key given both ways with different values is an error
(``ValueError: Conflicting argument ...``), as in DeepSpeed; aliases (``kernel_inject``, ``tp``,
``max_tokens``, ...) count as their field's name.

Every field either acts or is refused when set to something dsrun cannot honour, one line each, naming
the key (:func:`refusals`). What each one does is in ``docs/inference.md``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from dsrun.utils.errors import ConfigError, Problem, show

DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "int8": torch.int8,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,  # dsrun's addition: exactness checks
}


def _to_dtype(value: object) -> torch.dtype:
    """Any value given as an inference dtype, as its torch dtype (a ValueError for anything else)."""
    if isinstance(value, torch.dtype):
        if value in DTYPES.values():
            return value
        raise ValueError(f"{value} is not an inference dtype; allowed: torch.float16, torch.bfloat16, "
                         "torch.float32, torch.int8, torch.float64")
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise ValueError(f"{show(value)} is not an inference dtype; allowed: fp16, bf16, fp32, int8, fp64 "
                     "(or the torch dtypes)")


InferenceDType = Annotated[Any, BeforeValidator(_to_dtype)]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True,
                              protected_namespaces=())


class DeepSpeedTPConfig(_Config):
    """Tensor parallelism: split the model over ``tp_size`` ranks (the model-parallel process group)."""

    enabled: bool = True
    tp_size: int = Field(1, ge=1)
    mpu: Any = None  # an object with get_model_parallel_group() (Megatron's mpu)
    tp_group: Any = None  # a process group from dsrun.comm.new_group


class DeepSpeedMoEConfig(_Config):
    enabled: bool = True
    ep_size: int = Field(1, ge=1)
    moe_experts: list[int] = Field(default_factory=lambda: [1], alias="numExperts")
    type: Literal["standard", "residual"] = "standard"
    ep_mp_group: Any = None
    ep_group: Any = Field(None, alias="expert_group")


class ActivationQuantConfig(_Config):
    enabled: bool = True
    num_bits: int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int = Field(1, ge=1)


class WeightQuantConfig(_Config):
    enabled: bool = True
    num_bits: int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int = Field(1, ge=1)
    quantized_initialization: dict[str, Any] = Field(default_factory=dict)
    post_init_quant: dict[str, Any] = Field(default_factory=dict)


class QKVQuantConfig(_Config):
    enabled: bool = True


class QuantizationConfig(_Config):
    """Weight-only INT8 settings, used with ``dtype=torch.int8``."""

    enabled: bool = True
    activation: ActivationQuantConfig = Field(default_factory=ActivationQuantConfig)
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    qkv: QKVQuantConfig = Field(default_factory=QKVQuantConfig)


class InferenceCheckpointConfig(_Config):
    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


class DeepSpeedInferenceConfig(_Config):
    """Sets parameters for the inference engine (DeepSpeed's fields, defaults and aliases)."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    dtype: InferenceDType = torch.float16
    tensor_parallel: DeepSpeedTPConfig = Field(default_factory=DeepSpeedTPConfig, alias="tp")
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    zero: dict[str, Any] = Field(default_factory=dict)
    triangular_masking: bool = Field(True, alias="tm")
    moe: bool | DeepSpeedMoEConfig = Field(default_factory=dict)
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: str | dict[str, Any] | None = None
    base_dir: str = ""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: InferenceCheckpointConfig = Field(default_factory=InferenceCheckpointConfig,
                                                         alias="ckpt_config")
    return_tuple: bool = True
    training_mp_size: int = Field(1, ge=1)
    replace_method: str = "auto"
    injection_policy: dict[Any, Any] | None = Field(None, alias="injection_dict")
    injection_policy_tuple: tuple[Any, ...] | None = None
    config: Any = Field(None, alias="args")
    max_out_tokens: int = Field(1024, ge=1, alias="max_tokens")
    min_out_tokens: int = Field(1, ge=1, alias="min_tokens")
    transposed_mode: bool = False
    mp_size: int = Field(1, ge=1)
    mpu: Any = None
    ep_size: int = Field(1, ge=1)
    ep_group: Any = Field(None, alias="expert_group")
    ep_mp_group: Any = Field(None, alias="expert_mp_group")
    moe_experts: list[int] = Field(default_factory=lambda: [1])
    moe_type: Literal["standard", "residual"] = "standard"

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree in effect (``tensor_parallel.tp_size``, or the legacy ``mp_size``)."""
        if not self.tensor_parallel.enabled:
            return 1
        return self.mp_size if self.mp_size != 1 else self.tensor_parallel.tp_size

    @property
    def checkpoint_source(self) -> str | dict[str, Any] | None:
        return self.checkpoint if self.checkpoint is not None else self.checkpoint_config.checkpoint_dir

    @property
    def checkpoint_base_dir(self) -> str:
        return self.base_dir or self.checkpoint_config.base_dir or ""

    @field_validator("moe")
    @classmethod
    def _moe_flag_as_section(cls, value: bool | DeepSpeedMoEConfig) -> bool | DeepSpeedMoEConfig:
        """DeepSpeed's backward compatibility: ``moe=True`` / ``False`` is ``moe={"enabled": True / False}``."""
        return DeepSpeedMoEConfig(enabled=value) if isinstance(value, bool) else value

    @property
    def moe_enabled(self) -> bool:
        if isinstance(self.moe, DeepSpeedMoEConfig):
            return self.moe.enabled
        return bool(self.moe)


# what init_inference's ``config`` may be: a JSON file's path, a dict, or a built config
InferenceConfigSource = Union[str, os.PathLike, dict[str, Any], DeepSpeedInferenceConfig]


def _aliases() -> dict[str, str]:
    """alias -> field name, for every alias of the top-level config."""
    return {info.alias: name for name, info in DeepSpeedInferenceConfig.model_fields.items() if info.alias}


def _canonical(mapping: dict[str, Any]) -> dict[str, Any]:
    aliases = _aliases()
    return {aliases.get(key, key): value for key, value in mapping.items()}


def _read_config(config: InferenceConfigSource | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(Problem("init_inference(config=...)", f"no JSON file at {path}",
                                      "pass a dict or the path of a JSON file"))
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(Problem(str(path), f"is not valid JSON ({err})")) from None
        if not isinstance(loaded, dict):
            raise ConfigError(Problem(str(path), "must hold a JSON object"))
        return loaded
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, DeepSpeedInferenceConfig):
        return {name: getattr(config, name) for name in config.model_fields_set}
    raise ValueError(f"Expected a string path to an existing deepspeed config, or a dictionary. Received: {config}")


def merge_config(config: InferenceConfigSource | None = None, **kwargs: object) -> DeepSpeedInferenceConfig:
    """The four call forms of ``init_inference``: defaults, ``config`` only, kwargs only, or both (a key set
    both ways must have the same value). ``kwargs`` are config keys with any values (the schema checks them)."""
    from dsrun.config.problems import validate_model

    given = _canonical(_read_config(config))
    extra = _canonical(kwargs)
    for key, value in extra.items():
        if key in given and not _same(given[key], value):
            raise ValueError(f"Conflicting argument '{key}' in 'config':{given[key]} and kwargs:{value}")
    merged = {**given, **extra}
    if merged.get("moe") is None:
        merged.pop("moe", None)
    model, problems = validate_model(DeepSpeedInferenceConfig, merged, "init_inference")
    if problems:
        raise ConfigError(problems)
    assert isinstance(model, DeepSpeedInferenceConfig)
    if model.mp_size != 1 and "tensor_parallel" in model.model_fields_set \
            and model.tensor_parallel.tp_size not in (1, model.mp_size):
        raise ConfigError(Problem("init_inference.mp_size", f"{model.mp_size} disagrees with "
                                  f"tensor_parallel.tp_size={model.tensor_parallel.tp_size}",
                                  "mp_size is deprecated: set only tensor_parallel.tp_size"))
    return model


def _same(a: object, b: object) -> bool:
    """Do two values given for one key (of any type) agree?"""
    try:
        return bool(a == b)
    except Exception:  # tensors, process groups...
        return a is b


def refusals(config: DeepSpeedInferenceConfig, device_type: str) -> list[Problem]:
    """Settings dsrun cannot honour, each as one problem line (empty when all is well)."""
    p = "init_inference."
    out: list[Problem] = []
    if config.enable_cuda_graph and device_type != "cuda":
        out.append(Problem(p + "enable_cuda_graph", f"CUDA graphs need a CUDA device; this run is on {device_type}",
                           "leave it false"))
    elif config.enable_cuda_graph:
        out.append(Problem(p + "enable_cuda_graph", "CUDA-graph capture is not implemented yet", "leave it false"))
    for name in ("use_triton", "triton_autotune", "transposed_mode"):
        if getattr(config, name):
            out.append(Problem(p + name, "is not implemented in dsrun (no Triton kernels)", "leave it false"))
    if config.zero:
        out.append(Problem(p + "zero", "ZeRO-Inference is not implemented yet", "leave zero empty"))
    # moe, ep_size, moe_experts, moe_type, ep_group: checked against the model (dsrun.inference.moe.check)
    if config.training_mp_size != 1:
        out.append(Problem(p + "training_mp_size", f"got {config.training_mp_size}; dsrun trains without tensor "
                           "parallelism, so its checkpoints are whole (training_mp_size=1)", "leave it 1"))
    if config.replace_method != "auto":
        out.append(Problem(p + "replace_method", f"got {show(config.replace_method)}; only 'auto' exists"))
    if config.config is not None:
        out.append(Problem(p + "config", "a model config for kernel injection is not used by dsrun "
                           "(the fused path reads the dsrun GPT's own config)", "leave it unset"))
    if not config.return_tuple:
        out.append(Problem(p + "return_tuple", "dsrun keeps the model's own return convention",
                           "leave it true"))
    if not config.triangular_masking and not config.replace_with_kernel_inject:
        out.append(Problem(p + "triangular_masking", "acts only with replace_with_kernel_inject (the fused path, "
                           "the injected layers)", "leave it true, or turn kernel injection on"))
    if config.save_mp_checkpoint_path or config.checkpoint_config.save_mp_checkpoint_path:
        out.append(Problem(p + "save_mp_checkpoint_path", "saving tensor-parallel shards is not implemented yet; "
                           "dsrun reshards a whole checkpoint at load time instead", "leave it unset"))
    if config.min_out_tokens > config.max_out_tokens:
        out.append(Problem(p + "min_out_tokens", f"{config.min_out_tokens} exceeds max_out_tokens="
                           f"{config.max_out_tokens}"))
    out += _quant_refusals(config, p)
    return out


def _quant_refusals(config: DeepSpeedInferenceConfig, p: str) -> list[Problem]:
    out: list[Problem] = []
    quant = config.quant
    if "quant" in config.model_fields_set and config.dtype != torch.int8:
        out.append(Problem(p + "quant", "acts only with dtype=torch.int8 (weight-only INT8)",
                           "set dtype=torch.int8 or leave quant unset"))
    weight = quant.weight
    if weight.num_bits != 8:
        out.append(Problem(p + "quant.weight.num_bits", f"got {weight.num_bits}; dsrun quantizes weights to 8 bits"))
    if weight.q_type != "symmetric":
        out.append(Problem(p + "quant.weight.q_type", "only symmetric weight quantization is implemented"))
    for name in ("quantized_initialization", "post_init_quant"):
        if getattr(weight, name):
            out.append(Problem(p + f"quant.weight.{name}", "is not implemented: dsrun quantizes the loaded "
                               "float weights at init", "leave it empty"))
    if "activation" in quant.model_fields_set and quant.activation.enabled:
        out.append(Problem(p + "quant.activation", "activation quantization is not implemented (weights only)",
                           "set quant.activation.enabled=false"))
    return out
