"""What ``redundancy_clean`` does to each compressed module.

1. Pruning masks are made final (``topk`` from the learned scores, ``l1``/``snip_momentum`` from the
   stored mask, or computed now at the final density if training never reached the schedule offset) and
   multiplied into the weight (and the bias of pruned rows and channels).
2. With ``related_modules``, pruned rows, heads and channels are removed: the module's rows (and bias),
   the following Linear's columns; an attention output's head columns and the matching rows of Q/K/V
   (fused or separate) plus the head count attributes of their parent module (``n_head``, ``num_heads``,
   ``num_attention_heads``, ``n_heads``, ``all_head_size``); a Conv2d's output channels, its BatchNorm's
   channels and the next Conv2d's input channels. Without related modules the zeros stay in place.
3. Quantized weights take their ``target_bits`` values; the integer codes and scales are recorded on the
   model for :func:`dsrun.compression.export.save_compressed`.

Masks, scores and the compressed forward are then removed; a module keeping activation quantization keeps
its compressed forward (with only that).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from dsrun.utils.errors import Problem, UserError

from . import layers
from .layers import ModuleCompression, Pruning
from .quantizers import Quantized, dequantize, quantize

HEAD_COUNT_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
RECORD_ATTR = "_ds_compression_record"


@dataclass
class CleanRecord:
    """What redundancy_clean left for export: integer codes per weight and the changed module attributes."""

    quantized: dict[str, Quantized] = field(default_factory=dict)  # "module.weight" -> codes and scales
    structure: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> {attribute: new value}


def record_of(model: nn.Module) -> CleanRecord:
    return model.__dict__.setdefault(RECORD_ATTR, CleanRecord())


def final_mask(module: nn.Module, p: Pruning) -> torch.Tensor:
    """The bool mask over ``p``'s units that the cleaned model keeps."""
    if p.uses_scores:
        from .pruning import topk_mask

        return topk_mask(getattr(module, p.scores_name).detach().float(), p.dense_ratio) > 0
    if p.ready and (p.method != "snip_momentum" or p.density <= p.dense_ratio):
        return getattr(module, p.mask_name).clone()
    scores = None
    if p.method == "snip_momentum":
        snip = getattr(module, f"{p.kind}_snip_scores")
        scores = snip if bool(snip.any()) else None
    return layers.magnitude_mask(module.weight, p, scores=scores, density=p.dense_ratio)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    if isinstance(old, nn.Parameter):
        setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))
    else:
        module.register_buffer(name, value.contiguous())


def _set_attrs(record: CleanRecord, owner: nn.Module, name: str, **attrs: int) -> None:
    for attr, value in attrs.items():
        setattr(owner, attr, value)
    record.structure.setdefault(name, {}).update(attrs)


def _keep_rows(record: CleanRecord, module: nn.Module, name: str, rows: torch.Tensor) -> None:
    _replace(module, "weight", module.weight.detach()[rows])
    if module.bias is not None:
        _replace(module, "bias", module.bias.detach()[rows])
    _set_attrs(record, module, name, **({"out_channels": len(rows)} if isinstance(module, nn.Conv2d)
                                        else {"out_features": len(rows)}))


def _keep_columns(record: CleanRecord, module: nn.Module, name: str, cols: torch.Tensor) -> None:
    _replace(module, "weight", module.weight.detach()[:, cols])
    _set_attrs(record, module, name, **({"in_channels": len(cols)} if isinstance(module, nn.Conv2d)
                                        else {"in_features": len(cols)}))


def _keep_bn_channels(record: CleanRecord, bn: nn.BatchNorm2d, name: str, keep: torch.Tensor) -> None:
    for attr in ("weight", "bias", "running_mean", "running_var"):
        if getattr(bn, attr, None) is not None:
            _replace(bn, attr, getattr(bn, attr).detach()[keep])
    _set_attrs(record, bn, name, num_features=len(keep))


def _parent(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    parent_name = name.rpartition(".")[0]
    return parent_name, (model.get_submodule(parent_name) if parent_name else model)


def _remove_heads(model: nn.Module, record: CleanRecord, name: str, module: nn.Module, p: Pruning,
                  keep: torch.Tensor) -> None:
    heads, width = p.num_heads, module.in_features // p.num_heads
    kept_heads = torch.nonzero(keep).reshape(-1)
    cols = (kept_heads.unsqueeze(1) * width + torch.arange(width, device=keep.device)).reshape(-1)
    _keep_columns(record, module, name, cols)
    parents = {_parent(model, name)}
    for rel_name in p.related:
        rel = model.get_submodule(rel_name)
        chunk = heads * width
        if rel.out_features % chunk:
            raise UserError(Problem(f"head_pruning related module {rel_name}", f"has {rel.out_features} outputs, "
                                    f"not a multiple of the attention width {chunk}",
                                    "relate the Q/K/V projections of this attention output"))
        rows = torch.cat([c * chunk + cols for c in range(rel.out_features // chunk)])
        _keep_rows(record, rel, rel_name, rows)
        parents.add(_parent(model, rel_name))
    for parent_name, parent in parents:
        for attr in HEAD_COUNT_ATTRS:
            if getattr(parent, attr, None) == heads:
                _set_attrs(record, parent, parent_name, **{attr: len(kept_heads)})
        if getattr(parent, "all_head_size", None) == heads * width:
            _set_attrs(record, parent, parent_name, all_head_size=len(kept_heads) * width)


def _apply_pruning(model: nn.Module, record: CleanRecord, name: str, module: nn.Module, c: ModuleCompression) -> None:
    for p in list(c.prunings.values()):
        keep = final_mask(module, p)
        multiplier = c.weight_multiplier(module, p, keep.to(module.weight.dtype))
        with torch.no_grad():
            module.weight.mul_(multiplier)
            if module.bias is not None and p.kind in ("row", "channel"):
                module.bias.mul_(keep.to(module.bias.dtype))
        if not p.related:
            continue
        if p.kind == "head":
            _remove_heads(model, record, name, module, p, keep)
            continue
        if p.kind in ("row", "channel"):
            if getattr(module, "groups", 1) != 1:
                raise UserError(Problem(f"channel_pruning module {name}", "grouped convolutions cannot be "
                                        "channel-pruned with related modules", "prune without related_modules"))
            kept = torch.nonzero(keep).reshape(-1)
            _keep_rows(record, module, name, kept)
            for rel_name in p.related:
                rel = model.get_submodule(rel_name)
                if isinstance(rel, nn.BatchNorm2d):
                    _keep_bn_channels(record, rel, rel_name, kept)
                else:
                    _keep_columns(record, rel, rel_name, kept)


def _remove_state(module: nn.Module, c: ModuleCompression) -> None:
    for p in c.prunings.values():
        for attr in (p.mask_name, p.scores_name, f"{p.kind}_snip_scores"):
            if attr in module._buffers:
                del module._buffers[attr]
            if attr in module._parameters:
                del module._parameters[attr]


class Cleanable(Protocol):
    """What cleaning reads and marks of a compression plan (:class:`.compress.CompressionPlan`)."""

    cleaned: bool


def clean_model(model: nn.Module, plan: Cleanable) -> None:
    if getattr(plan, "cleaned", False):
        raise UserError(Problem("redundancy_clean", "this model was already cleaned", "clean a model once"))
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise UserError(Problem("redundancy_clean", "the model's parameters are partitioned by ZeRO-3",
                                "clean a model holding its full weights (e.g. the consolidated checkpoint: "
                                "dsrun export does this)"))
    record = record_of(model)
    compressed = [(n, m) for n, m in model.named_modules() if layers.is_compressed(m)]
    for name, module in compressed:
        if module.ds_compression.weight_owner is None:
            _apply_pruning(model, record, name, module, module.ds_compression)
    for name, module in compressed:
        c = module.ds_compression
        if c.weight is not None and c.weight_owner is None:
            q = quantize(module.weight.detach(), c.weight.spec(c.weight.target_bits))
            with torch.no_grad():
                module.weight.copy_(dequantize(q, module.weight.dtype))
            record.quantized[f"{name}.weight" if name else "weight"] = q
    for other in model.modules():  # BatchNorm hooks that masked pruned channels
        for handle in other.__dict__.pop("_ds_follower_hooks", []):
            handle.remove()
    for name, module in compressed:
        c = module.ds_compression
        _remove_state(module, c)
        if c.activation is not None:
            module.ds_compression = type(c)(name, activation=c.activation)
        else:
            layers.restore_class(module)
    plan.cleaned = True
