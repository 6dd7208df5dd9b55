"""DeepSpeed's ``ds_to_universal`` steps for a folder DeepSpeed wrote (its helpers by DeepSpeed's names): the
optimizer files and their ZeRO stage, the required ``universal_checkpoint_info``, and the ZeRO-3 conversion of a
``(tp, dp)`` grid of ``zero_pp_rank_<dp>_mp_rank_<tp>`` files, AutoTP included.

A ZeRO-3 file holds one data rank's partition of one tensor rank's parameters (each parameter cut in
``ceil(numel / dp)`` pieces, the last padded). :func:`convert_zero3` takes each parameter's padding-free piece of
every file (:func:`extract_zero_shards_stage3`, as DeepSpeed's intermediate slice files), then puts the data
ranks' pieces together and, over several tensor ranks, the tensor ranks' slices by the model's
``universal_checkpoint_info`` (:func:`.tp_slices.merge_tp_slices`); one tensor rank writes the flat value as
DeepSpeed does. dsrun's own checkpoints go to :func:`.ds_to_universal.ds_to_universal` instead, which reads by
byte range.
"""
from __future__ import annotations

import glob
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

from . import atomic
from .constants import (FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARAM_GROUPS, PARAM_SHAPES,
                        UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                        UNIVERSAL_CHECKPOINT_VERSION_VALUE, ZERO_STAGE)
from .deepspeed_checkpoint import DeepSpeedCheckpoint
from .safe_load import load_file
from .tp_slices import _merge_zero_shards, _save, _validate_autotp_conversion_support, dump_param_fragment, \
    merge_tp_slices
from .universal_checkpoint import LATEST_UNIVERSAL

MOMENTS = ("exp_avg", "exp_avg_sq")


def _natural_key(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _get_checkpoint_files(checkpoint_dir: str, glob_pattern: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def _get_optim_files(checkpoint_dir: str) -> list[str]:
    return _get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def _get_model_state_files(checkpoint_dir: str) -> list[str]:
    return _get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def _filter_zero3_optim_files(optim_files: list[str]) -> list[str]:
    return [f for f in optim_files if re.match(r"(?:bf16_)?zero_pp_rank_", os.path.basename(f))]


def _get_zero_stage(optim_files: list[str]) -> int:
    """The ZeRO stage the first optimizer file records (1 when it records none)."""
    return int(load_file(optim_files[0])[OPTIMIZER_STATE_DICT].get(ZERO_STAGE, 1))


def _inject_missing_state(ds_checkpoint: DeepSpeedCheckpoint) -> None:
    """Give a checkpoint without ``universal_checkpoint_info`` a minimal one (the current version only)."""
    if ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def _check_for_required_state(ds_checkpoint: DeepSpeedCheckpoint) -> None:
    info = ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
    assert info is not None, (f"Required {UNIVERSAL_CHECKPOINT_INFO} state is missing in checkpoint. Verify that "
                              "client creates this state.")
    _validate_autotp_conversion_support(info)


def _zero_partitioned_param_info(unpartitioned_numel: int, world_size: int) -> tuple[int, int]:
    """ZeRO-3's piece of a parameter of ``unpartitioned_numel`` over ``world_size`` ranks, and its padding."""
    remainder = unpartitioned_numel % world_size
    return math.ceil(unpartitioned_numel / world_size), (world_size - remainder) if remainder else 0


def _build_zero3_rank_grid(files: list[str]) -> tuple[list[list[str]], int, int]:
    """``grid[tp][dp]`` of ZeRO-3 files by the ranks in their names, with the degrees; a hole is refused."""
    grid: dict[int, dict[int, str]] = {}
    for path in files:
        match = re.search(r"(?:bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)", os.path.basename(path))
        if match is None:
            raise ValueError(f"Cannot parse ZeRO-3 tp/dp ranks from checkpoint file name: {path}")
        grid.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    tp_degree = max(grid) + 1
    dp_degree = max(max(ranks) for ranks in grid.values()) + 1
    for tp in range(tp_degree):
        for dp in range(dp_degree):
            if dp not in grid.get(tp, {}):
                raise RuntimeError(f"Missing ZeRO-3 checkpoint file for tp_rank={tp}, dp_rank={dp}")
    return [[grid[tp][dp] for dp in range(dp_degree)] for tp in range(tp_degree)], tp_degree, dp_degree


def extract_zero_shards_stage3(optim_files_grid: list[list[str]], param_shapes_grid: list[list[dict[str, Any]]],
                               dp_degree: int, temp_dir: str, indices: tuple[int, int]) -> None:
    """Write the padding-free piece of every parameter that ZeRO-3 file ``(tp, dp)`` holds (its fp32 master and
    Adam moments) as slice files under ``temp_dir``."""
    tp_index, dp_index = indices
    optim = load_file(optim_files_grid[tp_index][dp_index])[OPTIMIZER_STATE_DICT]
    partition_groups = optim.get("ds_zero_partition_groups") or []
    for idx, shapes in enumerate(param_shapes_grid[tp_index]):
        flat = {key: optim[OPTIMIZER_STATE_DICT]["state"][idx][key] for key in MOMENTS}
        flat["fp32"] = optim[FP32_FLAT_GROUPS][idx]
        group = partition_groups[idx] if idx < len(partition_groups) else {}
        count, rank = group.get("partition_count", dp_degree), group.get("partition_rank", dp_index)
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            piece, _ = _zero_partitioned_param_info(numel, count)
            held = max(0, min(piece, numel - rank * piece))
            for key, value in flat.items():
                dump_param_fragment(temp_dir, tp_index, dp_index, key, value, name, offset, held)
            offset += piece


def merge_zero3_slices(dp_degree: int, dir: str, slice_dir: str, name: str) -> None:
    """One tensor rank: the data ranks' pieces of ``name`` concatenated, written flat (DeepSpeed's form)."""
    for state in ("fp32", *MOMENTS):
        _save(_merge_zero_shards(os.path.join(slice_dir, name), state, 1)[0], os.path.join(dir, name, f"{state}.pt"))


def convert_zero3(input_folder: str, output_folder: str, optim_files: list[str], strict: bool = True,
                  keep_temp_folder: bool = False) -> None:
    """DeepSpeed's conversion of a ZeRO-3 checkpoint it wrote (any ``tp x dp`` grid) to a universal folder."""
    model_files = [f for f in _get_model_state_files(input_folder)
                   if not (os.path.basename(f).startswith("layer_") and "_expert_" in os.path.basename(f))]
    model_grid, tp_degree, dp_degree = _build_zero3_rank_grid(model_files)
    optim_grid, tp_optim, dp_optim = _build_zero3_rank_grid(optim_files)
    if (tp_degree, dp_degree) != (tp_optim, dp_optim):
        raise RuntimeError(f"ZeRO-3 model/optimizer tp_degree or dp_degree mismatch: model=({tp_degree},{dp_degree}),"
                           f" optim=({tp_optim},{dp_optim})")
    shapes_grid = [load_file(model_grid[tp][0])[PARAM_SHAPES] for tp in range(tp_degree)]
    info: dict[str, Any] = {}
    if tp_degree > 1:  # refuse an unconvertible layout before extracting anything
        info = load_file(model_files[0]).get(UNIVERSAL_CHECKPOINT_INFO) or {}
        _validate_autotp_conversion_support(info)
    temp_dir = os.path.join(output_folder, "tmp")
    for tp in range(tp_degree):
        for dp in range(dp_degree):
            extract_zero_shards_stage3(optim_grid, shapes_grid, dp_degree, temp_dir, (tp, dp))
    zero_dir = os.path.join(output_folder, "zero")
    names = {name for group in shapes_grid[0] for name in group}
    if tp_degree > 1:
        per_tp = [{k: v for group in grid for k, v in group.items()} for grid in shapes_grid]
        names = {name for shapes in per_tp for name in shapes}
        unmatched: Sequence[set[str]] = [merge_tp_slices(info, zero_dir, temp_dir, tp_degree,
                                                         (name, [shapes.get(name) for shapes in per_tp]))
                                         for name in sorted(names)]
        unused = sorted(set.intersection(*unmatched)) if unmatched else []
        if unused and strict:
            raise AssertionError(f"Unused patterns={unused} while merging tp slices")
        if unused:
            print(f"Warning: Unused patterns={unused} while merging tp slices")
    else:
        for name in sorted(names):
            merge_zero3_slices(dp_degree, zero_dir, temp_dir, name)
    optimizer_state = load_file(optim_files[0])[OPTIMIZER_STATE_DICT]
    optimizer_state[PARAM_GROUPS] = optimizer_state[OPTIMIZER_STATE_DICT][PARAM_GROUPS]
    _save(optimizer_state, os.path.join(zero_dir, "optimizer_state.pt"))
    if not keep_temp_folder:
        shutil.rmtree(temp_dir, ignore_errors=True)
    for path in model_files:
        shutil.copy2(path, output_folder)
    root, step_folder = os.path.split(os.path.normpath(output_folder))
    atomic.write_text(Path(root) / LATEST_UNIVERSAL, step_folder)
