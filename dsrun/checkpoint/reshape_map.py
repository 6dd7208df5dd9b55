"""DeepSpeed's checkpoint reshape library (``deepspeed.checkpoint.reshape_utils``, ``reshape_meg_2d``,
``reshape_3d_utils``): which saved files a rank of another (smaller) pipeline x tensor x data layout reads.

A checkpoint saved over ``pp x tp x dp`` ranks holds ``pp * tp`` model-states files (pipeline-major:
file ``i`` is stage ``i // tp``, tensor rank ``i % tp``) and ``pp * tp * dp`` ZeRO files (data-major).
:class:`meg_2d_parallel_map` maps each ``(pp, tp)`` cell to file indices; contracting a degree hands each new
cell a consecutive run of the old ones (:func:`reshape_meg_2d_parallel`), and :class:`model_3d_desc` does the
same for the ZeRO files, the data dimension flattened and cut again. Only contraction is possible (a file's
state is merged, never split). :func:`get_model_3d_descriptor` reads a folder's degrees: from the model states'
``checkpoint_parallel_dimensions`` when they record it (every file must, and agree), else from the file counts.
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any

import torch

from .constants import (BF16_ZERO_FILE_PREFIX, CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                        FP16_ZERO_FILE_PREFIX, LAYER_FILE_PREFIX, MODEL_FILE_PREFIX, ZERO_FILE_PREFIX)
from .safe_load import load_file

PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"


# --- reshape_utils: the files of a folder, and merging two ranks' states ---

def basic_folder_validation(dir: str) -> None:
    assert os.path.exists(dir), f"{dir} path does not exist"
    assert os.path.isdir(dir), f"{dir} is not a folder"


def get_files(dir: str) -> list[str]:
    """Every file under ``dir`` (recursively)."""
    return [os.path.join(root, name) for root, _, names in os.walk(dir) for name in names]


def get_files_with_prefix(all_files: list[str], prefix: str) -> list[str]:
    """The files of ``all_files`` whose name starts with ``prefix``, sorted."""
    return sorted(path for path in all_files if os.path.basename(path).startswith(prefix))


def validate_files(file_list: list[str]) -> None:
    for path in file_list:
        if not os.path.isfile(path):
            print(f"Error: {path} is not existent")


def sort_zero_files(files: list[str], prefix: str) -> list[str]:
    """ZeRO files ordered by (data rank, model rank), parsed from ``<prefix><dp>_mp_rank_<mp>``."""
    pattern = re.compile(f"{prefix}([0-9]+)_{MODEL_FILE_PREFIX}([0-9]+)")
    ranked = []
    for path in files:
        match = pattern.search(path)
        if not match:
            raise ValueError(f"Cannot parse dp_rank and mp_rank from {path}")
        ranked.append((int(match.group(1)), int(match.group(2)), path))
    return [path for _, _, path in sorted(ranked, key=lambda r: (r[0], r[1]))]


def get_zero_files(dir: str) -> list[str]:
    """The folder's ZeRO optimizer files (the first of the plain, fp16 and bf16 prefixes that has any), in rank
    order."""
    files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def partition_data(data_list: list[Any], num_partitions: int) -> list[list[Any]]:
    """``data_list`` cut into ``num_partitions`` consecutive runs of equal length."""
    assert len(data_list) % num_partitions == 0
    size = len(data_list) // num_partitions
    return [data_list[i:i + size] for i in range(0, len(data_list), size)]


def merge_state(state_a: object, state_b: object, key_list: list[str] | None = None) -> object:
    """Two ranks' states as one: tensors concatenated along dim 0, dicts merged key by key, lists item by item,
    anything else taken from ``state_a``."""
    keys = list(key_list or [])
    if type(state_a) is not type(state_b):
        raise ValueError(f"Cannot merge two states of types {type(state_a)} and type {type(state_b)} "
                         f"(at {'.'.join(keys)})")
    if isinstance(state_a, (dict, OrderedDict)):
        return merge_state_dict(state_a, state_b, keys)
    if isinstance(state_a, (list, tuple)):
        return type(state_a)(merge_state_list(state_a, state_b, keys))
    if torch.is_tensor(state_a):
        return torch.cat([state_a, state_b], 0)
    return state_a


def merge_state_dict(dict_a: dict, dict_b: dict, key_list: list[str]) -> dict:
    merged = type(dict_a)()
    for key, value in dict_b.items():
        merged[key] = merge_state(dict_a[key], value, [*key_list, str(key)]) if key in dict_a else value
    return merged


def merge_state_list(list_a: list | tuple, list_b: list | tuple, key_list: list[str]) -> list:
    if len(list_a) != len(list_b):
        raise ValueError(f"Cannot merge lists of different lengths, a = {len(list_a)} b = {len(list_b)} "
                         f"(at {'.'.join(key_list)})")
    return [merge_state(a, b, key_list) for a, b in zip(list_a, list_b)]


# --- reshape_meg_2d: the (pipeline, tensor) cells and their files ---

class meg_2d_parallel_map:
    """File indices per ``(pp_index, tp_index)`` cell of a ``pp_degree x tp_degree`` grid."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree, self.tp_degree = pp_degree, tp_degree
        self.map: dict[str, list[int]] = {}

    def simple_init(self) -> None:
        """Each cell holds its own file: index ``pp * tp_degree + tp`` (the saved, pipeline-major order)."""
        self.map = {self._make_key(i // self.tp_degree, i % self.tp_degree): [i]
                    for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list[int]) -> None:
        self._validate_indices(pp_index, tp_index)
        assert isinstance(data, list)
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The file indices of one cell, or of a whole row/column/grid where an index is None."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [idx for i in pps for j in tps for idx in self.map[self._make_key(i, j)]]

    def print_data(self, tag: str) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index: int | None, tp_index: int | None) -> None:
        assert pp_index is None or pp_index < self.pp_degree
        assert tp_index is None or tp_index < self.tp_degree

    @staticmethod
    def _make_key(i: int, j: int) -> str:
        return f"{i},{j}"


def _reshape_tp_dimension(old: meg_2d_parallel_map, new_tp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(old.pp_degree, new_tp_degree)
    for i in range(old.pp_degree):
        for j, ranks in enumerate(partition_data(old.get_data(pp_index=i), new_tp_degree)):
            new.add_data(i, j, ranks)
    return new


def _reshape_pp_dimension(old: meg_2d_parallel_map, new_pp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(new_pp_degree, old.tp_degree)
    for j in range(old.tp_degree):
        for i, ranks in enumerate(partition_data(old.get_data(tp_index=j), new_pp_degree)):
            new.add_data(i, j, ranks)
    return new


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """The saved files each cell of the smaller ``new_pp_degree x new_tp_degree`` grid reads: the tensor
    dimension contracted first, then the pipeline one."""
    assert new_pp_degree <= old_pp_degree
    assert new_tp_degree <= old_tp_degree
    grid = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    grid.simple_init()
    if verbose:
        grid.print_data("original_2d_map:")
    if old_tp_degree != new_tp_degree:
        grid = _reshape_tp_dimension(grid, new_tp_degree)
    if verbose:
        grid.print_data("after_tp_reshape:")
    if old_pp_degree != new_pp_degree:
        grid = _reshape_pp_dimension(grid, new_pp_degree)
    if verbose:
        grid.print_data("final_2d_map:")
    return grid


# --- reshape_3d_utils: with the data dimension ---

class model_3d_desc:
    """A ``pp x tp x dp`` layout; :meth:`reshape` maps another, smaller one onto its ZeRO files."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree, self.tp_degree, self.dp_degree = pp_degree, tp_degree, dp_degree

    def reshape(self, target_3d_desc: model_3d_desc, verbose: bool = False) -> list[meg_2d_parallel_map]:
        """Per target data rank, the 2-D map of the ZeRO file indices each of its cells reads."""
        valid, errors = self.can_reshape(target_3d_desc)
        assert valid, ",".join(errors)
        grid = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target_3d_desc.pp_degree,
                                       target_3d_desc.tp_degree, verbose)
        flat = flatten_dp_dimension(grid, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(flat, target_3d_desc.dp_degree)

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        errors = [f"{dim} indexing error: index {index} >= degree {degree}"
                  for index, degree, dim in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM),
                                             (dp_index, self.dp_degree, DP_DIM)) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc: model_3d_desc) -> tuple[bool, list[str]]:
        """Whether the target is a contraction in every dimension, and the reasons when not."""
        errors = [f"Expansion reshape not supported - {dim}: {mine} ---> {theirs}"
                  for dim, mine, theirs in ((PP_DIM, self.pp_degree, target_3d_desc.pp_degree),
                                            (TP_DIM, self.tp_degree, target_3d_desc.tp_degree),
                                            (DP_DIM, self.dp_degree, target_3d_desc.dp_degree)) if theirs > mine]
        return not errors, errors


def flatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, src_2d_size: int, dp_degree: int) -> meg_2d_parallel_map:
    """Each cell's file indices extended over every saved data rank (ZeRO file ``idx + d * src_2d_size``)."""
    flat = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for idx in meg_2d_map.get_data(i, j):
                flat.add_data(i, j, [idx + d * src_2d_size for d in range(dp_degree)])
    return flat


def unflatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, dp_degree: int) -> list[meg_2d_parallel_map]:
    """Each cell's files cut into ``dp_degree`` consecutive runs, one map per target data rank."""
    maps = [meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree) for _ in range(dp_degree)]
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for indices, grid in zip(partition_data(meg_2d_map.get_data(i, j), dp_degree), maps):
                grid.add_data(i, j, indices)
    return maps


def _recorded_degrees(model_file: str, dimensions: object) -> tuple[int, int]:
    if not isinstance(dimensions, dict):
        raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {model_file}.")
    values = []
    for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
        value = dimensions.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RuntimeError(f"Checkpoint {key} must be a positive integer in {model_file}, got {value!r}.")
        values.append(value)
    return values[0], values[1]


def get_model_3d_descriptor_from_metadata(file_list: list[str], zero_file_list: list[str],
                                          model_state_metadata: list[tuple[str, dict[str, Any]]]) -> model_3d_desc:
    """A folder's layout from its files and each model-states file's ``checkpoint_parallel_dimensions``
    (``[(file, {CHECKPOINT_PARALLEL_DIMS: ...})]``): the recorded degrees when any file records them (all must,
    and agree with each other and the file counts), else DeepSpeed's legacy inference from the file counts (a
    pipeline's ``layer_01`` files give the tensor degree)."""
    model_files = [path for path, _ in model_state_metadata]
    recorded, missing = [], []
    for path, metadata in model_state_metadata:
        dimensions = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dimensions is None:
            missing.append(path)
        else:
            recorded.append(_recorded_degrees(path, dimensions))
    if recorded:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(recorded)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
                               f"{recorded}")
        pp_degree, tp_degree = recorded[0]
        if len(model_files) != pp_degree * tp_degree:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp_degree} * {CHECKPOINT_TP_DEGREE}={tp_degree}.")
        if len(zero_file_list) % (pp_degree * tp_degree):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp_degree} * {CHECKPOINT_TP_DEGREE}={tp_degree}.")
        return model_3d_desc(pp_degree, tp_degree, max(1, len(zero_file_list) // (pp_degree * tp_degree)))
    stage_files = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    if stage_files:
        tp_degree = stage_files
        pp_degree = len(model_files) // tp_degree
    else:
        tp_degree, pp_degree = len(model_files), 1
    return model_3d_desc(pp_degree, tp_degree, max(1, len(zero_file_list) // (pp_degree * tp_degree)))


def get_model_3d_descriptor(dir: str) -> model_3d_desc:
    """The layout of the checkpoint folder ``dir`` (each model-states file read once, only its degrees kept)."""
    files = get_files(dir)
    metadata = []
    for path in get_files_with_prefix(files, MODEL_FILE_PREFIX):
        state = load_file(path)
        metadata.append((path, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS)}))
        del state
    return get_model_3d_descriptor_from_metadata(files, get_zero_files(dir), metadata)
