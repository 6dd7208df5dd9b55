"""``init_compression`` and ``redundancy_clean``: DeepSpeed's two calls of the compression library.

::

    from dsrun.compression.compress import init_compression, redundancy_clean
    model = init_compression(model, "ds_config.json")          # before dsrun.initialize (or let it do it)
    ...train...
    model = redundancy_clean(model, "ds_config.json")          # masks and quantization made real

``init_compression`` reads ``compression_training``, initialises a layer-reduced student from its teacher,
and gives every module a group names its compressed forward (:mod:`.layers`), with the masks and
learnable scores its techniques need. Nothing is active yet: the scheduler (:mod:`.scheduler`, stepped by
the engine) switches each technique on at its ``schedule_offset``. ``redundancy_clean`` then applies the
masks, quantizes the weights to their ``target_bits`` and physically removes what row, head and channel
pruning pruned when ``related_modules`` say where the matching columns are (:mod:`.clean`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from dsrun.config.compression import (ActivationQuantizationConfig, ChannelPruningConfig, CompressionConfig,
                                      HeadPruningConfig, PruneParams, RowPruningConfig, SparsePruningConfig,
                                      WeightQuantizationConfig, WeightQuantParams, check_compression)
from dsrun.config.sections import ds_section
from dsrun.config.sources import read_config_source
from dsrun.utils.errors import ConfigError, Problem, UserError

from . import layers, matching, pruning
from .layer_reduction import student_initialization
from .layers import ActivationQuantization, Pruning, WeightQuantization
from .quantizers import check_groups

if TYPE_CHECKING:
    from dsrun.config import ConfigSource, DSConfig

SECTION = "compression_training"
PLAN_ATTR = "_ds_compression_plan"
TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning", "head_pruning",
              "channel_pruning")
_ELIGIBLE = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d, nn.Embedding),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}
PruningConfig = Union[SparsePruningConfig, RowPruningConfig, HeadPruningConfig, ChannelPruningConfig]
TechniqueConfig = Union[WeightQuantizationConfig, ActivationQuantizationConfig, PruningConfig]
_KIND = {"sparse_pruning": "sparse", "row_pruning": "row", "head_pruning": "head", "channel_pruning": "channel"}


def read_config(deepspeed_config: ConfigSource | DSConfig | CompressionConfig) -> CompressionConfig:
    """The ``compression_training`` section of a DeepSpeed config (a path, a dict, JSON text or a loaded
    :class:`dsrun.config.DSConfig`), validated; a ConfigError lists every problem."""
    if isinstance(deepspeed_config, CompressionConfig):
        return deepspeed_config
    section = getattr(deepspeed_config, SECTION, None)
    if isinstance(section, CompressionConfig):
        return section
    model = ds_section(read_config_source(deepspeed_config), SECTION)  # a ConfigError lists its problems
    problems = check_compression(model, "")
    if problems:
        raise ConfigError(problems)
    return model


def is_enabled(config: CompressionConfig) -> bool:
    return config.layer_reduction.enabled or any(getattr(config, t).shared_parameters.enabled for t in TECHNIQUES)


@dataclass
class CompressionPlan:
    """What :func:`init_compression` set up: the config and, per technique, its groups' module names."""

    config: CompressionConfig
    groups: dict[str, list[tuple[str, list[str]]]] = field(default_factory=dict)  # technique -> [(group, names)]
    cleaned: bool = False

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """Every compressed module of ``model`` by name."""
        return {n: m for n, m in model.named_modules() if layers.is_compressed(m)}


def plan_of(model: nn.Module) -> CompressionPlan | None:
    model = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    return model.__dict__.get(PLAN_ATTR)


def _owners_of_tied_weights(model: nn.Module) -> dict[int, str]:
    """The first compressible module (in model order) holding each weight: a tied weight is compressed once,
    by it, and the other modules use its compressed value."""
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        if name and isinstance(module, layers.COMPRESSIBLE):
            owner.setdefault(id(module.weight), name)
    return owner


def _gathered(params: list[torch.Tensor]) -> Any:
    from dsrun.zero import GatheredParameters  # ZeRO-3 weights built under zero.Init are partitioned

    return GatheredParameters([p for p in params if isinstance(p, nn.Parameter)])


def _weight_quantization(model: nn.Module, cfg: WeightQuantizationConfig, names: list[str], group: str,
                         params: WeightQuantParams, where: str) -> None:
    shared = cfg.shared_parameters
    mixed = shared.fp16_mixed_quantize
    for name in names:
        module = model.get_submodule(name)
        rows = layers.full_shape(module.weight)[0]
        groups = rows if isinstance(module, nn.Embedding) else shared.quantize_groups  # embeddings: per token
        check_groups(layers.full_shape(module.weight).numel(), groups, f"{where}.shared_parameters.quantize_groups "
                     f"(module {name})")
        layers.make_compressed(module, name).weight = WeightQuantization(
            group=group, start_bits=params.start_bits, target_bits=params.target_bits,
            period=params.quantization_period, groups=groups, symmetric=shared.quantization_type == "symmetric",
            stochastic=shared.rounding == "stochastic", in_forward=shared.quantize_weight_in_forward,
            change_ratio=mixed.quantize_change_ratio if mixed.enabled else None)


def _pruning(model: nn.Module, technique: str, cfg: PruningConfig, names: list[str], related: list[list[str]],
             params: PruneParams, where: str) -> None:
    shared = cfg.shared_parameters
    kind = _KIND[technique]
    method = getattr(shared, "method", "topk")
    ratio = params.dense_ratio
    pattern = None
    if kind == "sparse":
        if method == "snip_momentum" and "dense_ratio" not in params.model_fields_set:
            ratio = shared.dense_ratio  # the global target, unless the group sets its own
        pattern = pruning.parse_block_pattern(shared.block_pattern, f"{where}.shared_parameters.block_pattern")
        if pattern is not None and pattern[1] == ":" and ratio < pattern[0] / pattern[2] - 1e-12:
            raise UserError(Problem(f"{where}.shared_parameters.block_pattern",
                                    f"{shared.block_pattern!r} keeps at least {pattern[0]} of every {pattern[2]} "
                                    f"(density {pattern[0] / pattern[2]:g}) but dense_ratio is {ratio}",
                                    "raise dense_ratio to N/M or pick another pattern"))
    for name, rel in zip(names, related):
        module = model.get_submodule(name)
        shape = layers.full_shape(module.weight)
        if pattern is not None:
            pruning.check_pattern_fits((shape[0], shape[1:].numel()), pattern,
                                       f"{where}.shared_parameters.block_pattern (module {name})")
        heads = getattr(shared, "num_heads", None)
        if kind == "head" and shape[1] % heads:
            raise UserError(Problem(f"{where}.shared_parameters.num_heads", f"module {name} has {shape[1]} input "
                                    f"features, not a multiple of num_heads={heads}",
                                    "name the attention output matrix and its head count"))
        c = layers.make_compressed(module, name)
        layers.register_pruning(module, Pruning(kind=kind, method=method, dense_ratio=ratio, pattern=pattern,
                                                num_heads=heads if kind == "head" else None, related=rel))
        for rel_name in rel if kind == "channel" else ():
            follower = model.get_submodule(rel_name)
            if isinstance(follower, nn.BatchNorm2d):
                layers.attach_batchnorm_mask(follower, module, c.prunings[kind])
        if method == "topk":
            p = c.prunings[kind]
            with _gathered([module.weight]), torch.no_grad():
                getattr(module, p.scores_name).data.copy_(layers.unit_scores(module.weight, p).reshape(
                    getattr(module, p.scores_name).shape))


def _technique_groups(model: nn.Module, technique: str, cfg: TechniqueConfig,
                      where: str) -> list[tuple[str, list[str]]]:
    """Attach ``technique`` to the modules its groups name; returns ``[(group, module names)]``."""
    shared = cfg.shared_parameters
    eligible = _ELIGIBLE[technique]
    claimed: set[str] = set()
    excluded = getattr(shared, "excluded_modules", None)
    groups = dict(cfg.different_groups)
    if technique == "sparse_pruning" and shared.method == "snip_momentum" and not groups:
        from dsrun.config.compression import PruneGroup

        groups = {"snip_momentum": PruneGroup(modules=["*"])}
        eligible = (nn.Linear, nn.Conv2d)
    owner = _owners_of_tied_weights(model)
    out: list[tuple[str, list[str]]] = []
    for group_name, group in groups.items():
        gwhere = f"{where}.different_groups.{group_name}"
        per_pattern = matching.select(model, group.modules, eligible, claimed, gwhere, excluded)
        names: list[str] = []
        related: list[list[str]] = []
        for i, found in enumerate(per_pattern):
            rel_patterns = (group.related_modules[i] if group.related_modules and i < len(group.related_modules)
                            else [])
            rel_types = (nn.Conv2d, nn.BatchNorm2d) if technique == "channel_pruning" else (nn.Linear,)
            rel = matching.related(model, found, rel_patterns, rel_types, f"{gwhere}.related_modules[{i}]")
            for name, r in zip(found, rel):
                module = model.get_submodule(name)
                target = owner.get(id(module.weight), name)
                if technique != "activation_quantization" and target != name:
                    if not isinstance(model.get_submodule(target), eligible) or technique in ("row_pruning",
                                                                                             "head_pruning"):
                        raise UserError(Problem(f"{gwhere}.modules", f"module {name} shares its weight with "
                                                f"{target}; {technique} cannot change a tied weight's shape",
                                                "leave the tied module out of this group"))
                    if target in names:
                        continue
                    name = target  # a tied weight is compressed by the module that owns it
                names.append(name)
                related.append(r)
        if technique == "weight_quantization":
            _weight_quantization(model, cfg, names, group_name, group.params, where)
        elif technique == "activation_quantization":
            for name in names:
                module = model.get_submodule(name)
                layers.make_compressed(module, name).activation = ActivationQuantization(
                    bits=group.params.bits, symmetric=shared.quantization_type == "symmetric",
                    dynamic=shared.range_calibration == "dynamic")
                if shared.range_calibration == "static":
                    layers.register_activation_range(module)
        else:
            _pruning(model, technique, cfg, names, related, group.params, where)
        out.append((group_name, names))
    return out


def _link_followers(model: nn.Module) -> None:
    """Modules whose tied weight another module compresses use that module's compressed weight."""
    owner = _owners_of_tied_weights(model)
    for name, module in model.named_modules():
        if not name or not isinstance(module, layers.COMPRESSIBLE):
            continue
        first = model.get_submodule(owner[id(module.weight)])
        if first is module or not layers.is_compressed(first):
            continue
        c = layers.make_compressed(module, name)
        c.weight_owner = first
        from dsrun.zero.module_gathers import add_external_param

        for p in first.parameters(recurse=False):  # ZeRO-3: the owner's scores are gathered for this module too
            if p is not module.weight:
                add_external_param(module, p)


def init_compression(model: nn.Module, deepspeed_config: ConfigSource | DSConfig | CompressionConfig,
                     teacher_model: nn.Module | None = None, mpu: object = None) -> nn.Module:
    """Prepare ``model`` for the compression ``deepspeed_config``'s ``compression_training`` describes and
    return it (the same object, changed in place).

    ``teacher_model`` initialises a layer-reduced student (``layer_reduction``); without one, the model's
    own layers ``teacher_layer`` are kept. ``mpu`` is accepted for DeepSpeed's signature: dsrun has no
    model-parallel layers to compress.
    """
    config = read_config(deepspeed_config)
    target = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    if target.__dict__.get(PLAN_ATTR) is not None:
        raise UserError(Problem("init_compression", "the model is already prepared for compression",
                                "call init_compression once (dsrun.initialize calls it when you have not)"))
    if config.layer_reduction.enabled:
        student_initialization(target, teacher_model, config.layer_reduction)
    plan = CompressionPlan(config)
    for technique in TECHNIQUES:
        cfg = getattr(config, technique)
        if cfg.shared_parameters.enabled:
            plan.groups[technique] = _technique_groups(target, technique, cfg, f"{SECTION}.{technique}")
    _link_followers(target)
    target.__dict__[PLAN_ATTR] = plan
    return model


def redundancy_clean(model: nn.Module, deepspeed_config: ConfigSource | DSConfig | CompressionConfig,
                     mpu: object = None) -> nn.Module:
    """Make the compression real: masked weights become zeros, quantized weights take their ``target_bits``
    values (recorded as integer codes for :func:`dsrun.compression.export.save_compressed`), and row, head
    and channel pruning with ``related_modules`` remove the pruned rows, heads and channels. Activation
    quantization stays in the forward. Returns the model. ``mpu`` is accepted for DeepSpeed's signature
    (any object; unused)."""
    from .clean import clean_model

    read_config(deepspeed_config)  # validate, as DeepSpeed reads it
    target = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    plan = target.__dict__.get(PLAN_ATTR)
    if plan is None:
        raise UserError(Problem("redundancy_clean", "the model was not prepared by init_compression",
                                "call init_compression(model, config) before training"))
    clean_model(target, plan)
    return model

