"""What an AutoTP-split parameter records for universal checkpoints, as DeepSpeed records it
(``deepspeed.module_inject.layers``' metadata, ``deepspeed.checkpoint.universal_checkpoint``'s restore).

Every parameter a tensor-parallel layer cuts carries ``ds_autotp_universal_checkpoint_meta``
(:data:`DS_AUTOTP_UC_META`): the *restore* view (its whole ``logical_shape``, the ``partition_dim`` it was cut
along, each rank's ``partition_sizes``, the fused sub-parameters' ``sub_param_sizes`` and each one's per-rank
``sub_param_shard_widths``, this rank's ``target_partition_shape``, whether it is ``replicated``) and, under
``"conversion"``, the subset the converter needs. :func:`collect_autotp_universal_checkpoint_info` turns the
conversion views of a model into DeepSpeed's model-level ``universal_checkpoint_info`` (row-parallel weights,
the parameters every rank holds whole, the vocabulary-cut ones with the vocabulary size, the fused ones with their
widths, the layouts no merge can undo with the reason); :func:`_resolve_autotp_partition` cuts a rank's slice out
of a whole universal value by the restore view. dsrun's own split (:mod:`dsrun.tensor_parallel.split`) and
DeepSpeed's layer classes (:mod:`dsrun.tensor_parallel.deepspeed_layers`) both record it
(:func:`mark_split`).
"""
from __future__ import annotations

import re
from typing import Any, Sequence, Union

import torch
from torch import nn

from .constants import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, DS_AUTOTP_UC_META, ORIGINAL_VOCAB_SIZE,
                        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHARD_WIDTHS,
                        TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                        UNIVERSAL_CHECKPOINT_VERSION_VALUE, VOCABULARY_PARAMETER_PATTERNS)


def shard_bounds(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s ``(start, length)`` of ``total`` entries cut over ``size`` ranks as evenly as possible: the
    first ``total % size`` ranks hold one more (DeepSpeed's AutoTP shard sizes in grains of one). Even when
    ``size`` divides ``total``."""
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


Widths = tuple[tuple[int, ...], ...]  # per fused part, each tensor-parallel rank's length along the split dim
Parts = Union[int, Widths]  # a split's parts: a count of equal parts cut evenly (shard_bounds), or explicit widths


def rank_widths(length: int, parts: Parts, size: int) -> Widths:
    """The widths of a split whose parts are ``parts`` along a dimension of ``length``: explicit widths as they
    are, ``n`` equal parts each cut by :func:`shard_bounds`."""
    if not isinstance(parts, int):
        return tuple(tuple(int(w) for w in part) for part in parts)
    block = length // parts
    return tuple(tuple(shard_bounds(block, rank, size)[1] for rank in range(size)) for _ in range(parts))


def _normalize_uc_shape(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return tuple(value) if value is not None else None


def _build_param_uc_conversion_meta(*, partition_type: str, partition_dim: int | None = None,
                                    sub_param_shape: Sequence[Any] | None = None,
                                    sub_param_shard_widths: Sequence[Sequence[int]] | None = None,
                                    original_shape: Sequence[int] | None = None, is_bias: bool = False,
                                    replicated: bool = False, unsupported_reason: str | None = None
                                    ) -> dict[str, Any]:
    """The conversion view: what :func:`collect_autotp_universal_checkpoint_info` publishes."""
    return {"partition_type": partition_type, "partition_dim": partition_dim,
            "sub_param_shape": _normalize_uc_shape(sub_param_shape), "sub_param_shard_widths": sub_param_shard_widths,
            "original_shape": _normalize_uc_shape(original_shape), "is_bias": is_bias, "replicated": replicated,
            "unsupported_reason": unsupported_reason}


def _build_param_uc_restore_meta(*, partition_type: str, partition_dim: int | None = None,
                                 logical_shape: Sequence[int] | None = None, output_shape: Sequence[int] | None = None,
                                 sub_param_shape: Sequence[Any] | None = None,
                                 sub_param_sizes: Sequence[int] | None = None,
                                 sub_param_shard_widths: Sequence[Sequence[int]] | None = None,
                                 partition_sizes: Sequence[int] | None = None,
                                 target_partition_shape: Sequence[int] | None = None,
                                 original_shape: Sequence[int] | None = None, is_bias: bool = False,
                                 replicated: bool = False, unsupported_reason: str | None = None) -> dict[str, Any]:
    """The metadata a split parameter carries: the restore view, shapes as tuples, with the conversion view
    nested under ``"conversion"``."""
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE, "partition_type": partition_type,
            "partition_dim": partition_dim, "logical_shape": _normalize_uc_shape(logical_shape),
            "output_shape": _normalize_uc_shape(output_shape), "sub_param_shape": _normalize_uc_shape(sub_param_shape),
            "sub_param_sizes": _normalize_uc_shape(sub_param_sizes), "sub_param_shard_widths": sub_param_shard_widths,
            "partition_sizes": _normalize_uc_shape(partition_sizes),
            "target_partition_shape": _normalize_uc_shape(target_partition_shape),
            "original_shape": _normalize_uc_shape(original_shape), "is_bias": is_bias, "replicated": replicated,
            "conversion": _build_param_uc_conversion_meta(
                partition_type=partition_type, partition_dim=partition_dim, sub_param_shape=sub_param_shape,
                sub_param_shard_widths=sub_param_shard_widths, original_shape=original_shape, is_bias=is_bias,
                replicated=replicated, unsupported_reason=unsupported_reason)}


def _get_param_uc_restore_meta(param: torch.Tensor) -> dict[str, Any] | None:
    """The metadata ``param`` carries (its top level is the restore view), None when it carries none."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def _get_param_uc_conversion_meta(param: torch.Tensor) -> dict[str, Any] | None:
    """The conversion view of ``param``'s metadata, None when it carries none."""
    meta = getattr(param, DS_AUTOTP_UC_META, None)
    return meta.get("conversion") if meta else None


def mark_split(param: torch.Tensor, *, row: bool, dim: int, whole_shape: Sequence[int],
               widths: Sequence[Sequence[int]], is_bias: bool = False) -> None:
    """Record on ``param`` (this rank's slice) how it was cut: along ``dim`` of ``whole_shape``, ``widths`` per
    fused part each rank's length (one part: a plain cut). A cut the converter's default concatenation would not
    undo (fused parts, or a dimension other than a column split's 0 / a row split's 1, as GPT-2's ``Conv1D``
    layout has) also records its parts as sub-parameters with their per-rank widths, which DeepSpeed's converter
    merges part by part along ``dim``."""
    sizes = tuple(sum(part) for part in widths)
    per_rank = tuple(sum(part[r] for part in widths) for r in range(len(widths[0])))
    plain_dim = 1 if row and not is_bias else 0
    fused = len(widths) > 1 or dim != plain_dim
    sub_shape = None
    if fused:
        spec: list[Any] = [-1] * len(whole_shape)  # a view spec, as DeepSpeed's layers record it
        spec[dim] = sizes
        sub_shape = tuple(spec)
    setattr(param, DS_AUTOTP_UC_META, _build_param_uc_restore_meta(
        partition_type="row" if row else "column", partition_dim=dim, logical_shape=whole_shape,
        output_shape=(whole_shape[0],), sub_param_shape=sub_shape, sub_param_sizes=sizes if fused else None,
        sub_param_shard_widths=[list(part) for part in widths] if fused else None, partition_sizes=per_rank,
        target_partition_shape=tuple(param.shape), original_shape=whole_shape, is_bias=is_bias))


def mark_replicated(param: torch.Tensor, *, row: bool, is_bias: bool = True) -> None:
    """Record that every rank holds ``param`` whole (a row-parallel layer's bias)."""
    shape = tuple(getattr(param, "ds_shape", None) or param.shape)
    setattr(param, DS_AUTOTP_UC_META, _build_param_uc_restore_meta(
        partition_type="row" if row else "column", partition_dim=None, logical_shape=shape, output_shape=shape,
        original_shape=shape, is_bias=is_bias, replicated=True))


def _meta_from_marks(module: nn.Module, param: torch.Tensor) -> dict[str, Any] | None:
    """A split parameter that records no metadata but carries Megatron's marks (``tensor_model_parallel``, its
    ``partition_dim``, and either explicit ``partition_widths`` or ``partition_stride`` equal parts cut evenly over
    its layer's ``tp_size``): its metadata recorded from them, so it is never taken for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False) or getattr(param, "partition_dim", None) is None:
        return None
    dim, widths = int(param.partition_dim), getattr(param, "partition_widths", None)
    shape = list(getattr(param, "ds_shape", None) or param.shape)
    if widths is None:
        size, parts = int(getattr(module, "tp_size", 1)), int(getattr(param, "partition_stride", 1) or 1)
        if size <= 1:
            return None
        shape[dim] *= size  # an even cut: every rank holds the same length
        widths = rank_widths(shape[dim], parts, size)
    else:
        shape[dim] = sum(sum(part) for part in widths)
    mark_split(param, row=bool(getattr(module, "row_parallel", False)), dim=dim, whole_shape=tuple(shape),
               widths=[list(part) for part in widths], is_bias=param is getattr(module, "bias", None))
    return _get_param_uc_conversion_meta(param)


def collect_autotp_universal_checkpoint_info(model: nn.Module) -> dict[str, Any]:
    """DeepSpeed's model-level ``universal_checkpoint_info`` of an AutoTP model, from its parameters' conversion
    views (a module's ``_mark_uc_metadata()`` is called first, to record the current state). Each parameter is
    named by a ``^name$`` pattern of its first name (a tied alias is skipped: the optimizer knows one name). A
    parameter without metadata is one AutoTP left whole: replicated. A weight cut along dim 0 whose name holds
    ``embed`` or ``lm_head`` is a vocabulary parameter, the first one's whole rows the vocabulary size."""
    rows, whole, vocab, fused = [], [], [], []
    widths_of: dict[str, list[list[int]]] = {}
    unsupported: dict[str, str] = {}
    vocab_size = None
    first = {id(param): name for name, param in model.named_parameters()}
    for module_name, module in model.named_modules():
        marker = getattr(module, "_mark_uc_metadata", None)
        if callable(marker):
            marker()
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            if first.get(id(param), name) != name:
                continue
            pattern = f"^{re.escape(name)}$"
            meta = _get_param_uc_conversion_meta(param) or _meta_from_marks(module, param)
            if not meta:
                whole.append(pattern)
                continue
            if meta.get("unsupported_reason"):
                unsupported[pattern] = meta["unsupported_reason"]
                continue
            if meta.get("replicated"):
                whole.append(pattern)
            if meta.get("partition_type") == "row" and not meta.get("is_bias", False):
                rows.append(pattern)
            shape, dim = meta.get("original_shape"), meta.get("partition_dim")
            if shape and len(shape) == 2 and dim == 0 and ("embed" in name or "lm_head" in name):
                vocab.append(pattern)
                vocab_size = shape[0] if vocab_size is None else vocab_size
            sub_shape = meta.get("sub_param_shape")
            if sub_shape is not None and dim is not None:
                published = list(sub_shape)
                widths = meta.get("sub_param_shard_widths")
                if widths is not None:  # publish the widths' sums, never a count a reader could take for a width
                    published[dim] = tuple(sum(w) for w in widths)
                    widths_of[pattern] = [list(w) for w in widths]
                fused.append({"patterns": [pattern], "shape": published, "partition_dim": dim})
    info: dict[str, Any] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(set(rows)),
                            TP_REPLICATED_PARAMETER_PATTERNS: sorted(set(whole)),
                            VOCABULARY_PARAMETER_PATTERNS: sorted(set(vocab)), PARAMETER_WITH_SUB_PARAMS: fused,
                            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: unsupported}
    if widths_of:
        info[SUB_PARAM_SHARD_WIDTHS] = widths_of
    if vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = vocab_size
    return info


# --- restore: a rank's slice of a whole universal value ---

def _narrow_sub_params(full_view: torch.Tensor, partition_dim: int, sub_dim_sizes: Sequence[int],
                       shard_widths: Sequence[Sequence[int]] | None, tp_rank: int, tp_world_size: int,
                       uc_version: float) -> torch.Tensor:
    """Rank ``tp_rank``'s piece of every sub-parameter of ``full_view`` along ``partition_dim``, concatenated and
    flattened. Before UCP 0.4 no widths were recorded: only an even split (every size divisible) is accepted."""
    assert sum(sub_dim_sizes) == full_view.shape[partition_dim], (
        f"Sub-parameter sizes {list(sub_dim_sizes)} sum to {sum(sub_dim_sizes)}, but dimension {partition_dim} "
        f"of the parameter is {full_view.shape[partition_dim]}. The metadata describes a different parameter.")
    if uc_version < 0.4:
        uneven = [size for size in sub_dim_sizes if size % tp_world_size]
        assert not uneven, (f"Sub-parameter sizes {uneven} are not divisible by tp_world_size {tp_world_size}, and "
                            "this metadata records no sub_param_shard_widths, so its uneven layout cannot be "
                            "reconstructed.")
        shard_widths = [[size // tp_world_size] * tp_world_size for size in sub_dim_sizes]
    assert shard_widths is not None and len(shard_widths) == len(sub_dim_sizes), (
        f"Got {0 if shard_widths is None else len(shard_widths)} shard width entries for {len(sub_dim_sizes)} "
        "sub-parameters.")
    pieces, offset = [], 0
    for size, widths in zip(sub_dim_sizes, shard_widths):
        assert len(widths) == tp_world_size, (f"Sub-parameter of size {size} has {len(widths)} shard widths, "
                                              f"expected one per tp rank ({tp_world_size}).")
        assert sum(widths) == size, f"Sub-parameter shard widths {list(widths)} sum to {sum(widths)}, expected {size}."
        pieces.append(full_view.narrow(partition_dim, offset + sum(widths[:tp_rank]), widths[tp_rank]))
        offset += size
    return torch.cat(pieces, dim=partition_dim).flatten()


def _resolve_autotp_partition(current_param: torch.Tensor, ckpt_dict: dict[str, Any], full_hp_param: torch.Tensor,
                              tp_rank: int, tp_world_size: int) -> torch.Tensor | None:
    """Rank ``tp_rank``'s flat slice of the whole value ``full_hp_param`` by ``current_param``'s restore view: whole
    when replicated; per sub-parameter with their widths; by ``partition_sizes``; evenly only when the dimension
    divides (an uneven cut without recorded sizes is refused: torch.chunk's cut is not AutoTP's). None when the
    parameter carries no metadata. A layout the converter refuses is refused here too (RuntimeError)."""
    meta = _get_param_uc_restore_meta(current_param)
    if not meta:
        return None
    reason = (meta.get("conversion") or {}).get("unsupported_reason")
    if reason:
        raise RuntimeError(f"Cannot restore a universal checkpoint into this AutoTP parameter: {reason}")
    dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        assert dim is None
        return full_hp_param.flatten()
    logical = meta.get("logical_shape")
    if dim is None or logical is None:
        return None
    full_view = full_hp_param.view(logical)
    sizes = meta.get("sub_param_sizes")
    sub_shape = meta.get("sub_param_shape")
    if sizes is None and sub_shape is not None:  # older metadata: the sizes from the view spec
        if hasattr(sub_shape, "shape") and hasattr(sub_shape, "partition_dim"):
            dim, sub_shape = sub_shape.partition_dim, sub_shape.shape
        sizes = sub_shape[dim]
    if sizes is not None:
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)
        return _narrow_sub_params(full_view, dim, sizes, meta.get("sub_param_shard_widths"), tp_rank, tp_world_size,
                                  meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
    partition_sizes = meta.get("partition_sizes")
    if partition_sizes is not None:
        return full_view.narrow(dim, sum(partition_sizes[:tp_rank]), partition_sizes[tp_rank]).flatten()
    length = full_view.shape[dim]
    assert length % tp_world_size == 0, (
        f"Dimension {dim} of size {length} is not divisible by tp_world_size {tp_world_size}, and this checkpoint "
        "records no partition_sizes, so its uneven layout cannot be reconstructed.")
    return full_view.chunk(tp_world_size, dim=dim)[tp_rank].flatten()
