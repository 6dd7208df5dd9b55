"""MoE inference with expert parallelism: the ``moe`` section of ``init_inference`` (and the legacy top-level
``ep_size``, ``moe_experts``, ``moe_type``) for models built from :class:`dsrun.moe.layer.MoE` layers.

As automatic tensor parallelism keeps each rank's slices of a whole model, :func:`spread_experts` keeps each
rank's experts of a whole one: a model built with ``ep_size=1`` (every expert on every rank, loaded from any
checkpoint) is spread over expert-parallel groups of ``ep_size`` ranks, each rank keeping
``num_experts / ep_size`` experts of every layer; tokens then reach their experts through the layers' own
all-to-alls. A model already built with that ``ep_size`` is used as it is (its experts are placed when it is
built). ``moe_experts`` (one count per MoE layer, or one for all) and ``moe_type`` (``residual``: PR-MoE's
Residual MoE) describe the model and are checked against it; a disagreement is a config error, never ignored.

Checkpoints name experts by global id (``...deepspeed_experts.{G}...``): a dsrun training checkpoint of an MoE
model (``mp_rank_00_model_states.pt`` plus DeepSpeed's ``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``
files, any ZeRO stage and expert-parallel size) or a state-dict file of the whole model;
:func:`localize` keeps and renames the entries of this rank's experts before they are loaded.
"""
from __future__ import annotations


import torch
from torch import nn

from dsrun import comm
from dsrun.moe.layer import moe_layers, split_experts
from dsrun.utils.errors import ConfigError, Problem

from .config import DeepSpeedInferenceConfig, DeepSpeedMoEConfig

KEY = "init_inference.moe"
MARK = "deepspeed_moe.experts.deepspeed_experts."


def settings(config: DeepSpeedInferenceConfig) -> tuple[int | None, list[int] | None, str | None]:
    """(ep_size, moe_experts, moe_type) the config asks for; ``None`` where it leaves the model's own."""
    section = config.moe if isinstance(config.moe, DeepSpeedMoEConfig) else None
    given = set(section.model_fields_set) if section is not None else set()
    ep = section.ep_size if "ep_size" in given else (config.ep_size if "ep_size" in config.model_fields_set
                                                      else None)
    experts = section.moe_experts if "moe_experts" in given else (
        config.moe_experts if "moe_experts" in config.model_fields_set else None)
    kind = section.type if "type" in given else (config.moe_type if "moe_type" in config.model_fields_set
                                                 else None)
    return ep, experts, kind


def check(model: nn.Module, config: DeepSpeedInferenceConfig) -> list[Problem]:
    """The MoE settings ``model`` cannot honour (empty when it has no MoE layers and none were asked for)."""
    layers = moe_layers(model)
    ep, experts, kind = settings(config)
    asked = ep is not None or experts is not None or kind is not None or (
        config.moe_enabled and "moe" in config.model_fields_set)
    if not layers:
        return [Problem(KEY, f"{type(model).__name__} has no dsrun.moe.layer.MoE layers to run with expert "
                        "parallelism", "leave moe, ep_size, moe_experts and moe_type unset")] if asked else []
    out = []
    if isinstance(config.moe, DeepSpeedMoEConfig) and not config.moe.enabled or config.moe is False:
        out.append(Problem(KEY + ".enabled", f"is false, but {type(model).__name__} has {len(layers)} MoE "
                           "layer(s), which always route through their experts", "leave moe.enabled true"))
    for name in ("ep_group", "ep_mp_group"):
        section = config.moe if isinstance(config.moe, DeepSpeedMoEConfig) else None
        if getattr(config, name) is not None or (section is not None and getattr(section, name) is not None):
            out.append(Problem(f"{KEY}.{name}", "a user-made expert group is not implemented yet: dsrun makes "
                               "the expert groups from ep_size", f"leave {name} unset"))
    if ep is not None:
        built = sorted({layer.ep_size for layer in layers})
        if built != [1] and built != [ep]:
            out.append(Problem(KEY + ".ep_size", f"is {ep}, but the model's MoE layers were built with ep_size "
                               f"{built}", "build the model with ep_size=1 (then any ep_size spreads it) or "
                               "leave ep_size unset"))
        for layer in layers:
            if layer.num_experts % ep:
                out.append(Problem(KEY + ".ep_size", f"{ep} does not divide a layer's {layer.num_experts} "
                                   "experts", "choose an ep_size that divides every layer's num_experts"))
                break
    if experts is not None:
        counts = [layer.num_experts for layer in layers]
        expected = experts * len(layers) if len(experts) == 1 else experts
        if list(expected) != counts:
            out.append(Problem(KEY + ".moe_experts", f"is {experts}, but the model's MoE layers hold {counts} "
                               "experts", f"set moe_experts={counts} or leave it unset"))
    if kind is not None:
        residual = {layer.use_residual for layer in layers}
        if residual != {kind == "residual"}:
            out.append(Problem(KEY + ".type", f"is {kind!r}, but the model's MoE layers are "
                               f"{'residual' if residual == {True} else 'standard' if residual == {False} else 'mixed'}",
                               "set it to what the model was built with, or leave it unset"))
    if config.tp_size > 1:
        out.append(Problem("init_inference.tensor_parallel.tp_size", "tensor parallelism of an MoE model is not "
                           "implemented yet (experts are spread with expert parallelism instead)",
                           "leave tp_size 1 and set moe.ep_size"))
    if config.dtype == torch.int8:
        out.append(Problem("init_inference.dtype", "INT8 weight quantization of an MoE model is not implemented "
                           "yet", "use torch.float16, torch.bfloat16 or torch.float32"))
    if config.replace_with_kernel_inject:
        out.append(Problem("init_inference.replace_with_kernel_inject", "the fused path has no MoE layers",
                           "leave it false"))
    return out


def spread_experts(model: nn.Module, config: DeepSpeedInferenceConfig) -> int:
    """Spread whole MoE layers over expert-parallel groups (collective); returns the expert-parallel size."""
    layers = moe_layers(model)
    ep, _, _ = settings(config)
    if not layers:
        return 1
    if ep is None or ep == 1:
        return max(layer.ep_size for layer in layers)
    comm.init_distributed(verbose=False)
    world = comm.get_world_size()
    if world % ep:
        raise ConfigError(Problem(KEY + ".ep_size", f"{ep} does not divide the world size {world}",
                                  f"launch a multiple of {ep} ranks (dsrun launch --num_procs {ep} ...)"))
    for layer in layers:
        if layer.ep_size == 1:
            split_experts(layer, ep)
        elif not layer._parallel_set:
            layer.set_deepspeed_parallelism()
    return ep


def localize(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with experts by global id -> this rank's experts by local index (others dropped)."""
    layers = moe_layers(model)
    if not layers or all(layer.ep_size == 1 for layer in layers):
        return state_dict
    prefixes = {id(m): name for name, m in model.named_modules()}
    renames: dict[str, str | None] = {}
    for layer in layers:
        base = prefixes[id(layer)]
        head = (base + "." if base else "") + MARK
        local = {g: j for j, g in enumerate(layer.global_expert_ids())}
        for key in state_dict:
            if key.startswith(head):
                g, _, tail = key[len(head):].partition(".")
                renames[key] = f"{head}{local[int(g)]}.{tail}" if int(g) in local else None
    out = {k: v for k, v in state_dict.items() if k not in renames}
    out.update({new: state_dict[old] for old, new in renames.items() if new is not None})
    return out


__all__ = ["check", "localize", "settings", "spread_experts"]
