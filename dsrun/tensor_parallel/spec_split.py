"""Split a model for training by DeepSpeed's configurable AutoTP rules (``tensor_parallel.partition_config`` /
``preset_model``: :class:`dsrun.tensor_parallel.autotp_config.AutoTPConfig`).

Every linear of the model (``nn.Linear``, GPT-2's ``Conv1D``) is named by its weight (``<module>.weight``) and
split as the first matching spec says: ``column`` keeps this rank's slice of the output features (and of the bias),
``row`` its slice of the input features (the bias stays whole, added once after the all-reduce), ``skip`` or no
match keeps it whole (``strict_mode`` refuses a linear no spec names). A spec's ``shape`` splits fused
sub-parameters each on its own, as the automatic split cuts GPT-2's q|k|v; ``gather_output`` all-gathers a column's
output slices so every rank gets the whole output (an untied LM head); ``grad_allreduce`` sums a whole parameter's
gradient over the group. An attention module whose projections are split column-wise has its head counts and
widths divided as in the automatic split (:func:`dsrun.inference.auto_tp.split_head_attrs`), so the module's own
forward reshapes by the heads this rank holds. Linears already split (DeepSpeed's ``LinearLayer`` built by the
user) are left as they are.

A plain ``nn.Linear`` (or a module a rule names that holds a 2-D ``weight`` and computes ``x @ weight.T + bias``,
as DeepSpeed replaces it) becomes DeepSpeed's ``LinearLayer`` / ``LinearAllreduce``
(:mod:`dsrun.tensor_parallel.deepspeed_layers`, on the automatic split's layers), one with fused sub-parameters
(``shape``) its ``SubParamLinearLayer`` / ``SubParamLinearAllreduce`` (:mod:`dsrun.tensor_parallel.subparam_layers`),
a Conv1D the automatic split's column/row layers (:mod:`dsrun.tensor_parallel.layers`); the parameters keep their objects and
names, and the returned :class:`~dsrun.tensor_parallel.split.TPLayout` is the same record, so checkpoints, their
merge and the universal conversion read a split by rules as they read the automatic one. An attention module's
projections are cut on whole heads, each fused part's evenly (``shape: [[q, k, v], -1]``: unequal parts, each on its
own heads); the rest as DeepSpeed cuts it in grains of ``tensor_parallel.tp.tp_grain_size``
(:func:`dsrun.tensor_parallel.split.cut_widths`). Not built (refused with the layer named): heads that do not divide
by the degree, logical shapes of more than two dimensions, ``gather_output`` with a shape, a split embedding tied to
another module's weight. An ``nn.Embedding`` a column or row spec names is cut as DeepSpeed's AutoTP cuts it, along
its hidden columns (:func:`slice_embedding`: each rank's output is its slice of the hidden features).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

from dsrun import comm
from dsrun.checkpoint.autotp_meta import DS_AUTOTP_UC_META, _build_param_uc_restore_meta
from dsrun.checkpoint.tensor_parallel import Parts, part_count, rank_widths
from dsrun.inference.auto_tp import HEAD_ATTRS, WIDTH_ATTRS, split_head_attrs
from dsrun.inference.groups import TPGroup
from dsrun.inference.layers import is_conv1d, is_linear, out_in
from dsrun.utils.errors import ConfigError, Problem

from .autotp_config import AutoTPConfig, PartitionType, TPLayerSpec, partition_config_object
from .deepspeed_layers import LinearAllreduce, LinearLayer, gather_output_slices
from .hf_plan import rules_from_hf_plan
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLinear
from .shard_sizes import get_shard_size_list
from .split import (TPLayout, cut_parameter, cut_widths, head_dim_of, model_num_kv_heads, split_meta_model,
                    uneven_kv_share)
from .subparam_layers import SubParamLinearAllreduce, SubParamLinearLayer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("DeepSpeed")


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear whose output slices (``sizes``: each rank's width, uneven allowed) are all-gathered
    over the group (``gather_output``): every rank gets the whole output; the backward keeps this rank's slice of
    the output's gradient."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, transposed: bool,
                 group: ProcessGroup | None, tp_size: int, tp_rank: int, sizes: list[int], name: str | None = None):
        super().__init__(weight, bias, transposed, group, tp_size, tp_rank, name)
        self.shard_sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.tp_size == 1:
            return y
        return gather_output_slices(y, self.shard_sizes, self.tp_rank, self.group)


def model_type_of(model: nn.Module) -> str | None:
    """The model's ``config.model_type`` (what a spec's ``model_types`` names), lower-case."""
    value = getattr(getattr(model, "config", None), "model_type", None)
    return str(value).lower() if value else None


def _part_sizes(spec: TPLayerSpec, name: str, out_features: int, in_features: int) -> list[int]:
    """The sizes of the fused sub-parameters along the split dimension (one part: the whole dimension), checked
    against the weight: ``shape: [n, -1]`` n equal parts, ``shape: [[q, k, v], -1]`` parts of those sizes."""
    split_dim = 0 if spec.partition_type is PartitionType.COLUMN else 1
    dims = (out_features, in_features)
    if spec.shape is None:
        return [dims[split_dim]]
    if len(spec.shape) != 2:
        raise ConfigError(Problem(name, f"shape {list(spec.shape)}: logical shapes of more than the weight's "
                                  "(out, in) dimensions are not built"))
    if spec.get_partition_dim() != split_dim:
        raise ConfigError(Problem(name, f"partition_dim {spec.get_partition_dim()} for a "
                                  f"{spec.partition_type.value} split (which cuts dimension {split_dim})"))
    for index, entry in enumerate(spec.shape):
        if index != split_dim and isinstance(entry, int) and entry not in (-1, dims[index]):
            raise ConfigError(Problem(name, f"shape {list(spec.shape)} does not fit its weight {list(dims)}"))
    if spec.gather_output and (spec.get_num_sub_params() or 1) > 1:
        raise ConfigError(Problem(name, "gather_output with fused sub-parameters (shape) is not built (nor in "
                                  "DeepSpeed)"))
    sizes = spec.get_sub_param_sizes()
    if sizes is not None:
        if sum(sizes) != dims[split_dim]:
            raise ConfigError(Problem(name, f"sub-parameter sizes {list(sizes)} do not add up to {dims[split_dim]}"))
        return list(sizes)
    parts = spec.get_num_sub_params() or 1
    what = "output" if split_dim == 0 else "input"
    if dims[split_dim] % parts:
        raise ConfigError(Problem(name, f"its {dims[split_dim]} {what} features do not split into {parts} equal "
                                  "sub-parameters"))
    return [dims[split_dim] // parts] * parts


def _weight_owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """The modules holding each weight, by the weight's id (a tied LM head and its embedding share one)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append((name, module))
    return owners


def _linear_like(module: nn.Module) -> bool:
    """A module a rule may split as a linear although it is not ``nn.Linear`` (DeepSpeed's AutoTP replaces any
    matched module with a weight): a 2-D ``weight`` ``[out, in]``, no bias or one of ``out``, no submodules; its
    forward must be ``x @ weight.T + bias``, which the split layer computes."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 2 and not any(True for _ in module.children())
            and (bias is None or isinstance(bias, nn.Parameter) and tuple(bias.shape) == (weight.shape[0],)))


def slice_embedding(child: nn.Embedding, name: str, group: ProcessGroup | None, tp_rank: int, tp_size: int
                    ) -> nn.Embedding:
    """DeepSpeed's AutoTP cut of an embedding (``AutoTP._slice_embedding``): its hidden columns (dim 1) cut by
    DeepSpeed's shard sizes under ``name``, this rank keeping its slice in a new ``nn.Embedding`` (every row of the
    vocabulary, ``hidden/tp`` wide), whose weight records DeepSpeed's row-partition metadata (``partition_dim`` 1, the
    whole shape, every rank's width). Each rank's output is its slice of the hidden features, for a row-parallel
    consumer. The weight keeps its ``Parameter`` object (an optimizer built before still holds it) and the embedding
    its ``padding_idx``; ``max_norm`` would renormalize slices, not rows, and is refused (ValueError)."""
    if child.max_norm is not None:
        raise ValueError(f"AutoTP: embedding {name} has max_norm={child.max_norm}; a column slice cannot be "
                         "renormalized as a whole row (drop max_norm, or leave the embedding unsplit)")
    weight = child.weight
    whole = tuple(weight.shape)
    sizes = get_shard_size_list(whole[1], tp_size, name)
    with torch.no_grad():
        weight.data = weight.data.narrow(1, sum(sizes[:tp_rank]), sizes[tp_rank]).clone()
    sliced = nn.Embedding(whole[0], sizes[tp_rank], padding_idx=child.padding_idx,
                          scale_grad_by_freq=child.scale_grad_by_freq, sparse=child.sparse, device="meta")
    sliced.weight = weight  # the meta weight it was built with is dropped
    sliced.tp_size, sliced.tp_rank, sliced.group, sliced.name = tp_size, tp_rank, group, name
    setattr(weight, DS_AUTOTP_UC_META, _build_param_uc_restore_meta(
        partition_type="row", partition_dim=1, logical_shape=whole, output_shape=whole, partition_sizes=sizes,
        target_partition_shape=tuple(weight.shape), original_shape=whole))
    child.replaced = True
    return sliced


def _summed_over(group: ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gradient hook of a ``grad_allreduce`` parameter: its gradient summed over the group."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=group)
        return grad
    return hook


def _parallel_layer(module: nn.Module, row: bool, dim: int, parts: Parts, gather: bool, group: ProcessGroup | None,
                    tp: TPGroup, sizes: list[int], name: str) -> nn.Module:
    """The split layer of ``module`` (its weight cut along ``dim``): DeepSpeed's ``LinearLayer`` /
    ``LinearAllreduce`` for a plain ``nn.Linear`` (so ``isinstance`` checks against DeepSpeed's classes hold), cut
    by ``sizes``; dsrun's column/row layers for a Conv1D or fused sub-parameters, cut part by part."""
    if not is_conv1d(module) and part_count(parts) == 1:
        placement = {"tp_rank": tp.rank, "tp_size": tp.size, "shard_sizes": sizes, "name": name}
        if row:
            return LinearAllreduce(module, group, **placement)
        return LinearLayer(module, group, gather_output=gather, **placement)
    if not is_conv1d(module):  # fused sub-parameters: DeepSpeed's SubParam layers, cut by dsrun's widths
        widths = rank_widths(module.weight.shape[dim], parts, tp.size)
        sub = tuple(sum(part) for part in widths)
        placement = {"tp_rank": tp.rank, "tp_size": tp.size, "subparam_shard_widths": widths, "name": name}
        if row:
            return SubParamLinearAllreduce(module, group, shape=(-1, sub), partition_dim=1, **placement)
        return SubParamLinearLayer(module, group, shape=(sub, -1), partition_dim=0, **placement)
    cut_parameter(module.weight, dim, parts, tp)
    if module.bias is not None and not row:
        cut_parameter(module.bias, 0, parts, tp)
    if gather and not row:
        return GatheredColumnParallelLinear(module.weight, module.bias, is_conv1d(module), group, tp.size, tp.rank,
                                           sizes, name)
    kind = RowParallelLinear if row else ColumnParallelLinear
    return kind(module.weight, module.bias, is_conv1d(module), group, tp.size, tp.rank, name)


def split_by_specs(model: nn.Module, config: AutoTPConfig, group: ProcessGroup | None, tp_rank: int,
                   tp_size: int, source: str = "tensor_parallel.partition_config", grain: int = 1,
                   only: set[str] | None = None) -> TPLayout:
    """Replace each linear a spec splits by this rank's column-/row-parallel slice (in place, keeping the
    parameters); returns the layout. Attention projections are cut on whole heads, the rest in grains of
    ``grain`` (:func:`dsrun.tensor_parallel.split.cut_widths`). ConfigError (``source``, where the rules came
    from, and the linear named) when a spec cannot act on its linear. ``only``: the module names that may be
    split (DeepSpeed's ``AutoTP`` walk chose them); None: every one a spec matches."""
    tp = TPGroup(group, tp_rank, tp_size)
    layout = TPLayout(tp_size, tp_rank)
    model_type = model_type_of(model)
    attention: dict[int, tuple[nn.Module, str]] = {}
    plan: list[tuple[nn.Module, str, str, nn.Module, TPLayerSpec]] = []
    embeddings: list[tuple[nn.Module, str, str, nn.Embedding]] = []
    for parent_name, parent in model.named_modules():
        if isinstance(parent, TensorParallelLinear):
            continue
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, TensorParallelLinear) or only is not None and name not in only:
                continue  # split already (a DeepSpeed layer the user built), or not chosen
            spec = config.find_matching_spec(f"{name}.weight", model_type)
            if isinstance(child, nn.Embedding) and spec is not None and spec.partition_type is not PartitionType.SKIP:
                embeddings.append((parent, attr, name, child))
                continue
            if not (is_linear(child) or _linear_like(child) and spec is not None
                    and spec.partition_type is not PartitionType.SKIP):
                continue
            if spec is None:
                if config.strict_mode:
                    raise ConfigError(Problem(f"{source}: {name}.weight", "no layer spec "
                                              "matches this linear (strict_mode)", "add a spec, or a skip spec"))
                continue
            plan.append((parent, attr, name, child, spec))
    owners = _weight_owners(model)
    kv_heads = model_num_kv_heads(model)
    share = uneven_kv_share(kv_heads, tp_size, tp_rank)  # this rank's key/value groups when they do not divide
    for parent, attr, name, module, spec in plan:
        if spec.partition_type is PartitionType.SKIP:
            continue
        tied = next((other for other, holder in owners.get(id(module.weight), []) if holder is not module), None)
        if tied is not None:
            if spec.partition_type is PartitionType.COLUMN and spec.gather_output:
                log.warning("AutoTP: %s.weight is tied to %s.weight; both stay whole (a vocabulary-parallel "
                            "embedding is not built)", name, tied)
                continue
            raise ConfigError(Problem(f"{source}: {name}.weight", f"is tied to "
                                      f"{tied}.weight, which would be cut with it", "skip it"))
        where = f"{source}: {name}"
        out_features, in_features = out_in(module)
        row = spec.partition_type is PartitionType.ROW
        parts = cut_widths(_part_sizes(spec, where, out_features, in_features), tp_size, head_dim_of(parent), grain,
                           where, kv_heads, name=name)
        out_dim = 1 if is_conv1d(module) else 0  # a Conv1D stores [in, out]
        dim = (1 - out_dim) if row else out_dim
        layout.record(f"{name}.weight", module.weight, dim, parts)
        if module.bias is not None and not row:
            layout.record(f"{name}.bias", module.bias, 0, parts)
        widths = rank_widths(in_features if row else out_features, parts, tp_size)
        sizes = [sum(part[r] for part in widths) for r in range(tp_size)]
        setattr(parent, attr, _parallel_layer(module, row, dim, parts, spec.gather_output, group, tp, sizes, name))
        if not row and not spec.gather_output and any(isinstance(getattr(parent, a, None), int)
                                                      for a in HEAD_ATTRS + WIDTH_ATTRS):
            attention[id(parent)] = (parent, name.rsplit(".", 1)[0])
    for parent, where in attention.values():
        split_head_attrs(parent, tp, where, share)
    for parent, attr, name, embedding in embeddings:  # DeepSpeed's cut of its hidden columns
        tied = next((other for other, holder in owners.get(id(embedding.weight), []) if holder is not embedding), None)
        if tied is not None:
            raise ConfigError(Problem(f"{source}: {name}.weight", f"is tied to {tied}.weight, which would be cut "
                                      "with it along its hidden columns", "skip it"))
        sizes = get_shard_size_list(embedding.weight.shape[1], tp_size, name)
        layout.record(f"{name}.weight", embedding.weight, 1, (tuple(sizes),))
        setattr(parent, attr, slice_embedding(embedding, name, group, tp_rank, tp_size))
    for param_name, param in model.named_parameters():
        spec = config.find_matching_spec(param_name, model_type)
        if spec is not None and spec.grad_allreduce and tp_size > 1:
            param.register_hook(_summed_over(group))
    return layout


def meta_split_for(cfg: Mapping[str, Any]) -> Callable[[nn.Module, int], None]:
    """How the memory estimator splits a recipe's meta-device model for one rank (``cfg``: the composed run, its
    ``ds`` section), as training splits it: by the run's ``partition_config`` / ``preset_model`` rules, or its
    ``injection_policy_tuple``, else the model's Hugging Face plan, else automatically
    (:func:`dsrun.tensor_parallel.split.split_meta_model`)."""
    from dsrun.config import ds_section
    from dsrun.estimate.runspec import plain_config

    section = ds_section(plain_config(cfg).get("ds") or {}, "tensor_parallel")
    configured = partition_config_object(section.partition_config, section.preset_model, 1)
    grain = int(section.tp.tp_grain_size)
    policy = section.injection_policy_tuple  # each block's row-parallel linears (the feature checks the value)
    rows = None if policy is None else (policy,) if isinstance(policy, str) else tuple(policy)

    def split(model: nn.Module, tp_size: int) -> None:
        if configured is not None:
            split_by_specs(model, configured, None, 0, tp_size, grain=grain)
        elif rows is not None:
            split_meta_model(model, tp_size, grain, rows)
        elif (planned := rules_from_hf_plan(model, tp_size)) is not None:
            split_by_specs(model, planned, None, 0, tp_size, "the model's Hugging Face tp_plan", grain)
        else:
            split_meta_model(model, tp_size, grain)

    return split
