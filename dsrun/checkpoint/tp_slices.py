"""DeepSpeed's merge of tensor-parallel slices into universal values (``ds_to_universal.merge_tp_slices`` and
its helpers), on DeepSpeed's intermediate slice files.

DeepSpeed's conversion first writes each parameter's fragments as ``<slices>/<name>/<tp>/<state>.<dp>`` (flat
tensors, one per data-parallel rank, :func:`dump_param_fragment`), then :func:`merge_tp_slices` puts the data
ranks' fragments of each tensor-parallel rank together and the tensor ranks' slices into one whole value,
written as ``<out>/<name>/<state>.pt`` with how it was merged: replicated parameters from one slice (all must be
equal), averaged ones averaged, fused ones part by part with their per-rank widths (recorded as a
:class:`.universal_checkpoint.SubparamShape`), row-parallel ones along dim 1 and the rest along dim 0
(``cat_dim``); a vocabulary parameter loses its padding rows. The model's ``universal_checkpoint_info``
(:func:`.autotp_meta.collect_autotp_universal_checkpoint_info`) says which is which. dsrun's own conversion of
its checkpoints (:mod:`.ds_to_universal`) merges from the saved files directly, by byte range; this module serves
DeepSpeed's API and DeepSpeed-written slice folders.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from . import atomic
from .constants import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, CAT_DIM, ORIGINAL_VOCAB_SIZE,
                        PARAMETER_TO_AVERAGE_PATTERNS, PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
                        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS, PARAM, PARAM_N_SUB_PARAMS,
                        SUB_PARAM_SHAPE, SUB_PARAM_SHARD_WIDTHS, TP_REPLICATED_PARAMETER_PATTERNS,
                        UNIVERSAL_CHECKPOINT_VERSION_KEY, VOCAB_TENSOR, VOCABULARY_PARAMETER_PATTERNS)
from .safe_load import load_file
from .universal_checkpoint import SubparamShape

MERGED_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _save(obj: object, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic.save_torch(obj, Path(path))


def dp_index_to_str(dp_index: int) -> str:
    return f"{dp_index:0>2d}"


def dump_param_fragment(dir: str, tp_index: int, dp_index: int, state_name: str, state_flat_tensor: torch.Tensor | int,
                        param_name: str, offset: int, numel: int) -> None:
    """Write ``numel`` elements of ``state_flat_tensor`` from ``offset`` (a step as it is) as the fragment of
    ``param_name`` held by ranks ``(tp_index, dp_index)``."""
    folder = os.path.join(dir, param_name, str(tp_index))
    os.makedirs(folder, exist_ok=True)
    if state_name != "step" and torch.is_tensor(state_flat_tensor):
        state_flat_tensor = state_flat_tensor.narrow(0, offset, numel).clone()
    _save(state_flat_tensor, os.path.join(folder, f"{state_name}.{dp_index_to_str(dp_index)}"))


def _merge_zero_shards(param_base_path: str, state: str, tp_degree: int,
                       slice_shapes: Sequence[Sequence[int] | None] | None = None) -> list[Any]:
    """Each tensor-parallel rank's slice of ``state``: its data ranks' fragments concatenated (shaped by
    ``slice_shapes[tp]`` when given; a step taken once, all equal). A rank that wrote no fragment gets an empty
    slice of its recorded shape, so the slices stay in rank order; one whose recorded shape is not empty is
    refused (the extraction lost data)."""
    slices: list[Any] = []
    missing: list[tuple[int, int]] = []
    for tp_index in range(tp_degree):
        folder = os.path.join(param_base_path, str(tp_index))
        pattern = re.compile(re.escape(state) + r"\.([0-9]+)$")
        found = sorted((int(m.group(1)), name) for name in (os.listdir(folder) if os.path.isdir(folder) else [])
                       if (m := pattern.match(name)))
        if not found:
            missing.append((tp_index, len(slices)))
            continue
        shards = [load_file(os.path.join(folder, name)) for _, name in found]
        if state == "step":
            assert all(v == shards[0] for v in shards), "All shards must have the same step value"
            slices.append(shards[0])
        else:
            merged = torch.cat(shards, dim=0)
            slices.append(merged if slice_shapes is None else merged.reshape(slice_shapes[tp_index]))
    if missing and slice_shapes is not None and slices and torch.is_tensor(slices[0]):
        for tp_index, position in reversed(missing):
            shape = slice_shapes[tp_index]
            assert math.prod(shape) == 0, (f"No fragment files for tp rank {tp_index} of a parameter whose recorded "
                                           f"shape {tuple(shape)} is not empty.")
            slices.insert(position, torch.empty(shape, dtype=slices[0].dtype))
    return slices


def _resolve_logical_shape(logical_shape: list[int], total_numel: int, name: str) -> list[int]:
    """``logical_shape`` with its one placeholder (-1) dimension replaced by the size ``total_numel`` gives."""
    holes = [i for i, d in enumerate(logical_shape) if d is not None and d < 0]
    if not holes:
        return logical_shape
    assert len(holes) == 1, f"Sub-parameter shape {logical_shape} of {name} has {len(holes)} placeholder dimensions."
    known = math.prod(d for i, d in enumerate(logical_shape) if i not in holes)
    assert known > 0 and total_numel % known == 0, (f"Sub-parameter shape {logical_shape} of {name} cannot be "
                                                    f"resolved for a parameter with {total_numel} elements.")
    resolved = list(logical_shape)
    resolved[holes[0]] = total_numel // known
    return resolved


def _sub_param_layout(spec: SubparamShape, pattern: str, name: str, slices: list[torch.Tensor],
                      info: dict[str, Any], tp_degree: int) -> tuple[tuple[int, ...], list[list[int]], SubparamShape]:
    """A fused parameter's sub-parameter sizes, each one's per-rank widths, and its normalized shape: UCP 0.4
    records the widths (required); older metadata gives the sizes (or a count of equal parts, decoded from the
    slices) and only an even split."""
    dim = spec.partition_dim
    entry = spec.shape[dim]
    if info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0) >= 0.4:
        recorded = info.get(SUB_PARAM_SHARD_WIDTHS, {})
        assert pattern in recorded, (f"Universal checkpoint version {info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY)} "
                                     f"records no {SUB_PARAM_SHARD_WIDTHS} for {name}, whose pattern {pattern} "
                                     "declares sub-parameters.")
        sizes = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
        return sizes, [list(w) for w in recorded[pattern]], spec
    if isinstance(entry, (tuple, list)):
        sizes, normalized = tuple(entry), spec
    else:  # a count of equal sub-parameters, e.g. (3, -1) for q|k|v
        assert all(s.dim() > dim for s in slices), (f"Legacy sub-parameter metadata for {name} needs per-rank "
                                                   "shapes to recover its sub-parameter widths.")
        total = sum(s.shape[dim] for s in slices)
        assert entry > 0 and total % entry == 0, (f"Legacy sub-parameter count {entry} for {name} does not evenly "
                                                  f"divide its full partition dimension {total}.")
        sizes = (total // entry,) * entry
        shape = list(spec.shape)
        shape[dim] = sizes
        normalized = SubparamShape(patterns=spec.patterns, shape=tuple(shape), partition_dim=dim)
    uneven = [s for s in sizes if s % tp_degree]
    assert not uneven, (f"Sub-parameter sizes {uneven} of {name} are not divisible by tp_degree {tp_degree}, and "
                        f"this metadata predates {SUB_PARAM_SHARD_WIDTHS}, so its uneven layout cannot be "
                        "reconstructed.")
    return sizes, [[s // tp_degree] * tp_degree for s in sizes], normalized


def _merge_sub_params(spec: SubparamShape, sizes: Sequence[int], widths: list[list[int]],
                      slices: list[torch.Tensor], name: str) -> torch.Tensor:
    """The whole fused value: each rank's slice seen at its own widths, then each sub-parameter's pieces put
    together in rank order, the sub-parameters one after the other."""
    dim, tp_degree = spec.partition_dim, len(slices)
    for size, per_rank in zip(sizes, widths):
        assert len(per_rank) == tp_degree and sum(per_rank) == size, (
            f"Shard widths {list(per_rank)} for a sub-parameter of {name} do not tile its {size} over {tp_degree} "
            "ranks.")
    logical = [sum(d) if isinstance(d, (tuple, list)) else d for d in spec.shape]
    logical[dim] = sum(sizes)
    logical = _resolve_logical_shape(logical, sum(s.numel() for s in slices), name)
    views = []
    for rank, piece in enumerate(slices):
        shape = list(logical)
        shape[dim] = sum(w[rank] for w in widths)
        assert math.prod(shape) == piece.numel(), (f"tp rank {rank} of {name} holds {piece.numel()} elements, but "
                                                    f"its recorded shard widths describe a shape of {tuple(shape)}.")
        views.append(piece.view(shape))
    offsets, parts = [0] * tp_degree, []
    for per_rank in widths:
        parts.append(torch.cat([v.narrow(dim, offsets[r], per_rank[r]) for r, v in enumerate(views)], dim=dim))
        offsets = [o + w for o, w in zip(offsets, per_rank)]
    return torch.cat(parts, dim=dim)


def merge_tp_slices(uc_info: dict[str, Any], dir: str, slice_dir: str, tp_degree: int,
                    name_and_shapes: tuple[str, Sequence[Sequence[int] | None] | None]) -> set[str]:
    """Merge parameter ``name``'s slices under ``slice_dir`` (its per-rank shapes given) into ``dir/<name>/``:
    ``step.pt`` and one ``<state>.pt`` per optimizer state, each ``{"param": whole, ...how it was merged}``.
    Returns the patterns of ``uc_info`` that named no parameter so far (the caller intersects them)."""
    name, per_tp_shapes = name_and_shapes
    source, target = os.path.join(slice_dir, name), os.path.join(dir, name)
    lists = {key: list(uc_info.get(key, [])) for key in (
        TP_REPLICATED_PARAMETER_PATTERNS, PARAMETER_TO_AVERAGE_PATTERNS, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        VOCABULARY_PARAMETER_PATTERNS, PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0)}
    subs = [SubparamShape(**entry) for entry in uc_info.get(PARAMETER_WITH_SUB_PARAMS, [])]
    unmatched = {p for patterns in lists.values() for p in patterns} | {p for s in subs for p in s.patterns}

    def matched(key: str) -> str | None:
        hits = [p for p in lists[key] if re.match(p, name)]
        assert len(hits) <= 1, f"Got more than one matching patterns={hits} for {name}"
        if hits:
            unmatched.discard(hits[0])
        return hits[0] if hits else None

    sub, sub_pattern = next(((s, p) for s in subs for p in s.patterns if re.match(p, name)), (None, None))
    if sub_pattern is not None:
        unmatched.discard(sub_pattern)
    steps = _merge_zero_shards(source, "step", tp_degree, per_tp_shapes)
    if steps:
        _save(steps[0], os.path.join(target, "step.pt"))
    for state in MERGED_STATES:
        slices = _merge_zero_shards(source, state, tp_degree, per_tp_shapes)
        entry: dict[str, Any] = {}
        if matched(TP_REPLICATED_PARAMETER_PATTERNS):
            assert all(slices[0].equal(other) for other in slices[1:]), f"{name}: replicated slices differ"
            value = slices[0]
        elif matched(PARAMETER_TO_AVERAGE_PATTERNS):
            value = sum(slices) / len(slices)
        elif matched(PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0):
            halves = [torch.chunk(s, 2, dim=0) for s in slices]
            value = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            entry.update({CAT_DIM: 0, PARAM_N_SUB_PARAMS: 2})
        elif sub is not None:
            sizes, widths, normalized = _sub_param_layout(sub, sub_pattern, name, slices, uc_info, tp_degree)
            value = _merge_sub_params(sub, sizes, widths, slices, name)
            entry[SUB_PARAM_SHAPE] = normalized
        else:
            cat_dim = 1 if matched(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS) else 0
            value = torch.cat(slices, dim=cat_dim)
            entry[CAT_DIM] = cat_dim
        if matched(VOCABULARY_PARAMETER_PATTERNS):  # strip the padding rows
            value = value[:uc_info[ORIGINAL_VOCAB_SIZE], :]
            entry[VOCAB_TENSOR] = True
        entry[PARAM] = value
        _save(entry, os.path.join(target, f"{state}.pt"))
    return unmatched


def _validate_autotp_conversion_support(universal_checkpoint_info: dict[str, Any]) -> None:
    """Refuse (ValueError, every pattern with its reason) a checkpoint whose model recorded AutoTP layouts the
    merge cannot undo."""
    unsupported = universal_checkpoint_info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, {})
    if unsupported:
        details = ", ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
        raise ValueError(f"AutoTP universal checkpoint conversion is not supported for {details}.")


def _group_per_tp_shapes(slice_shapes_by_tp: list[dict[str, Any]], pp_degree: int, tp_degree: int
                         ) -> dict[str, list[Any]]:
    """``{name: [shape on tp rank 0, 1, ...]}`` from the model-states files' shapes in their pipeline-major order
    (file ``pp * tp_degree + tp``): each tensor rank's stages united, so a parameter of one stage is kept; a
    parameter stored by several stages (tied) must have one shape on a rank (AssertionError otherwise); a rank
    that lacks a parameter gives None."""
    per_tp = []
    for tp in range(tp_degree):
        shapes: dict[str, Any] = {}
        for pp in range(pp_degree):
            stage = slice_shapes_by_tp[pp * tp_degree + tp]
            for name in shapes.keys() & stage.keys():
                assert shapes[name] == stage[name], (f"Pipeline replicas of {name} on tp rank {tp} disagree on "
                                                     f"shape: {shapes[name]} vs {stage[name]}.")
            shapes.update(stage)
        per_tp.append(shapes)
    names = {name for shapes in per_tp for name in shapes}
    return {name: [shapes.get(name) for shapes in per_tp] for name in names}
