"""DeepSpeed's checkpoint-folder readers (``deepspeed.checkpoint.DeepSpeedCheckpoint``, ``ZeROCheckpoint``): a
tag folder seen through its pipeline x tensor x data layout, optionally contracted to a smaller one.

:class:`ZeROCheckpoint` maps each ``(pp, tp, dp)`` rank of a target layout to the saved ZeRO files it reads
(:mod:`.reshape_map`) and merges them (:func:`.reshape_map.merge_state`: tensors concatenated, the padding of
each group stripped). :class:`DeepSpeedCheckpoint` adds the model-states files (each read once, at
construction; only the degrees, parameter shapes, AutoEP layers and the few global entries such as
``universal_checkpoint_info`` are kept) and a pipeline's per-layer files. dsrun's own conversion
(:mod:`.ds_to_universal`) reads by byte range instead; these classes are DeepSpeed's API over the same files.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch

from .constants import (AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY, AUTOEP_ZERO12_REQUIRED_FIELDS,
                        BASE_OPTIMIZER_STATE, CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                        GROUP_PADDINGS, LAYER_FILE_PREFIX, MODEL_FILE_PREFIX, OPTIMIZER_STATE_DICT, PARAM_SHAPES,
                        PARTITION_COUNT, UNIVERSAL_CHECKPOINT_INFO)
from .reshape_map import (basic_folder_validation, get_files, get_files_with_prefix, get_model_3d_descriptor,
                          get_model_3d_descriptor_from_metadata, get_zero_files, meg_2d_parallel_map, merge_state,
                          model_3d_desc, partition_data, reshape_meg_2d_parallel)
from .safe_load import load_file

GROUP_STATE_KEY = "state"
EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
LAYER_FILE_PREFIX_PATTERN = r"layer_(\d+)-model_.*"
USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path") + AUTOEP_ZERO12_REQUIRED_FIELDS
# Megatron's layer entries that every tensor rank holds whole, and those cut along dim 1
SEQUENTIAL_LAYERS = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias",
                     "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias",
                     "position_embeddings.weight"]
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}


class ZeROCheckpoint:
    """The ZeRO files of the folder ``dir``, each target rank's list (:meth:`get_files_for_rank`) and merged
    state (:meth:`get_state_for_rank`); ``source_3d`` is the saved layout (read from the folder when None)."""

    def __init__(self, dir: str, source_3d: model_3d_desc | None = None) -> None:
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        assert self.num_files > 0, f"No ZeRO files found in {dir}"
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        assert dp_index < len(self._3d_file_map), f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}"
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int, keys_to_ignore: list[str] | None = None,
                           strip_tensor_paddings: bool = True) -> dict[str, Any] | None:
        """The target rank's files merged into one state (each file's group padding stripped first)."""
        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            state = load_file(path)
            for key in keys_to_ignore or []:
                state.pop(key, None)
            if strip_tensor_paddings:
                self._strip_tensor_paddings(state)
            merged = state if merged is None else merge_state(merged, state)
            self._update_partition_count(merged)
            if strip_tensor_paddings:
                self._clear_group_paddings(merged)
        return merged

    def print_3d_index_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            grid.print_data(f"dp = {dp_index}")

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    @staticmethod
    def _optimizer_entry(state: dict[str, Any], key: str) -> Any:
        return (state.get(OPTIMIZER_STATE_DICT) or {}).get(key)

    def _strip_tensor_paddings(self, state: dict[str, Any]) -> None:
        base = self._optimizer_entry(state, BASE_OPTIMIZER_STATE)
        groups = base.get(GROUP_STATE_KEY) if isinstance(base, dict) else None
        paddings = self._optimizer_entry(state, GROUP_PADDINGS)
        if groups is None or paddings is None:
            return
        for key, group_state in groups.items():
            if paddings[key] == 0:
                continue
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value):
                    group_state[name] = value.narrow(0, 0, value.numel() - paddings[key]).clone()

    def _clear_group_paddings(self, state: dict[str, Any]) -> None:
        paddings = self._optimizer_entry(state, GROUP_PADDINGS)
        if paddings:
            state[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)

    def _update_partition_count(self, state: dict[str, Any]) -> None:
        counts = self._optimizer_entry(state, PARTITION_COUNT)
        if counts:
            state[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)


def _lightweight(model_state: dict[str, Any]) -> dict[str, Any]:
    """What a model-states file contributes to the folder's description: its degrees, parameter shapes (flat),
    AutoEP layers (their descriptive fields) and the expert-ordering flag of its config; a malformed entry is kept
    as its type's name, for the readers to refuse."""
    dims = model_state.get(CHECKPOINT_PARALLEL_DIMS)
    if isinstance(dims, dict):
        dims = {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}
    elif dims is not None:
        dims = type(dims).__name__
    shapes = model_state.get(PARAM_SHAPES)
    if isinstance(shapes, (list, tuple)) and all(isinstance(group, dict) for group in shapes):
        shapes = {name: shape for group in shapes for name, shape in group.items()}
    elif shapes is not None:
        shapes = type(shapes).__name__
    autoep = model_state.get(AUTOEP_LAYERS_KEY, model_state.get(AUTOEP_LAYERS_KEY_LEGACY))
    if isinstance(autoep, list):
        autoep = [{k: entry[k] for k in AUTOEP_METADATA_FIELDS if k in entry} if isinstance(entry, dict)
                  else type(entry).__name__ for entry in autoep]
    elif autoep is not None:
        autoep = type(autoep).__name__
    config = model_state.get("ds_config", {})
    if isinstance(config, dict):
        ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        config = {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering if isinstance(ordering, bool)
                  else type(ordering).__name__}
    else:
        config = type(config).__name__
    return {CHECKPOINT_PARALLEL_DIMS: dims, PARAM_SHAPES: shapes, AUTOEP_LAYERS_KEY: autoep, "ds_config": config}


class DeepSpeedCheckpoint:
    """The tag folder ``dir`` read as DeepSpeed reads it, seen at ``tp_degree``/``pp_degree``/``dp_degree``
    (None: the saved degree; a smaller one merges files)."""

    def __init__(self, dir: str, tp_degree: int | None = None, pp_degree: int | None = None,
                 dp_degree: int | None = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX) -> None:
        self.dir, self.final_layer_norm_idx = dir, final_layer_norm_idx
        self.file_list = get_files(dir)
        self.layer_files = sorted(p for p in self.file_list
                                  if re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(p)))
        self._validate_folder(dir, bool(self.layer_files))
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        self.model_state_metadata, self.global_state = self._discover_model_state_metadata()
        source = get_model_3d_descriptor_from_metadata(self.file_list, get_zero_files(dir), self.model_state_metadata)
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=source)
        self.layer_keys = self._get_layer_keys()
        self.layer_count = len(self.layer_keys)
        self.tp_degree = source.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = source.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = source.dp_degree if dp_degree is None else dp_degree
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree)
        if self.is_change_pp_degree() or self.is_change_tp_degree() or self.is_change_dp_degree():
            self.zero_checkpoint.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))
        self._sanity_check()
        self.pp_to_transformer_map = self._build_pp_transformer_map()
        self.transformer_file_map = self._build_transformer_file_map()
        self.tp_to_embedding_map = self._build_tp_other_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._build_tp_other_layer_map(self.final_layer_norm_idx)

    def _discover_model_state_metadata(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
        """Each model-states file read once; only its description (and file 0's global entries) kept."""
        metadata, global_state = [], {}
        for index, path in enumerate(self.mp_rank_files):
            state = load_file(path)
            metadata.append((path, _lightweight(state)))
            if index == 0:
                global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                for key in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO):
                    global_state[key] = state.get(key)
            del state
        return metadata, global_state

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> dict[str, Any] | None:
        return self.zero_checkpoint.get_state_for_rank(pp_index, tp_index, dp_index, keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return self.zero_checkpoint.get_files_for_rank(pp_index, tp_index, dp_index)

    def _get_checkpoint_value(self, key: str) -> Any:
        if key not in self.global_state:
            self.global_state[key] = load_file(self.mp_rank_files[0]).get(key)
        return self.global_state[key]

    def get_iteration(self) -> int:
        return self._get_checkpoint_value(ITERATION_KEY) or 0

    def get_args(self) -> Any:
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        return self._get_checkpoint_value(info_key)

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        assert tp_index < self.tp_degree and pp_index < self.pp_degree
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict[str, Any] | None:
        """The model states of the target cell, its saved files merged."""
        merged = None
        for path in self.get_2d_parallel_files(tp_index, pp_index):
            state = load_file(path)
            merged = state if merged is None else merge_state(merged, state)
        return merged

    # a pipeline's per-layer files (layer_<i>-model_<tp>-model_states.pt)
    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list[str]:
        return self.tp_to_embedding_map[tp_index]

    def get_embedding_state(self, tp_index: int) -> dict[str, Any]:
        return self._merge_state_dicts([load_file(p) for p in self.tp_to_embedding_map[tp_index]])

    def get_final_norm_files(self, tp_index: int) -> list[str]:
        return self.tp_to_final_norm_map[tp_index]

    def get_final_norm_state(self, tp_index: int) -> dict[str, Any]:
        return load_file(self.tp_to_final_norm_map[tp_index][0])

    def get_pp_transformer_map(self, pp_index: int) -> list[str]:
        return self.pp_to_transformer_map[pp_index]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list[dict[str, Any]]:
        return [self._merge_state_dicts([load_file(p) for p in paths])
                for paths in self.transformer_file_map[(tp_index, pp_index)]]

    def _get_layer_keys(self) -> list[str]:
        ids = {re.search(LAYER_FILE_PREFIX_PATTERN, os.path.basename(p)).group(1) for p in self.layer_files}
        return [LAYER_FILE_PREFIX + i for i in sorted(ids, key=int)]

    def _build_tp_other_layer_map(self, layer_index: int) -> dict[int, list[str]]:
        if not self.layer_files:
            return {}
        files = get_files_with_prefix(self.layer_files, self.layer_keys[layer_index])
        return dict(enumerate(partition_data(files, self.tp_degree)))

    def _transformer_keys(self) -> list[str]:
        return self.layer_keys[1:self.final_layer_norm_idx]

    def _build_pp_transformer_map(self) -> dict[int, list[str]]:
        keys = self._transformer_keys()
        per_stage = len(keys) // self.pp_degree
        return {i: keys[i * per_stage:(i + 1) * per_stage] for i in range(self.pp_degree)}

    def _build_transformer_file_map(self) -> dict[tuple[int, int], list[list[str]]]:
        keys = self._transformer_keys()
        per_stage = max(1, len(keys) // self.pp_degree)
        file_map: dict[tuple[int, int], list[list[str]]] = {}
        for index, key in enumerate(keys):
            parts = partition_data(get_files_with_prefix(self.layer_files, key + "-"), self.tp_degree)
            for tp_index in range(self.tp_degree):
                file_map.setdefault((tp_index, index // per_stage), []).append(parts[tp_index])
        return file_map

    @staticmethod
    def _merge_state_dicts(states: list[dict[str, Any]]) -> dict[str, Any]:
        return {key: states[0][key] if key in SEQUENTIAL_LAYERS
                else torch.cat([s[key] for s in states], dim=LAYER_CONCAT_DIM.get(key, 0)) for key in states[0]}

    def _sanity_check(self) -> None:
        assert len(self.mp_rank_files) % self.tp_degree == 0
        assert self.zero_checkpoint.num_files % (self.pp_degree * self.tp_degree) == 0

    @staticmethod
    def _validate_folder(dir: str, pipeline_parallel: bool) -> None:
        basic_folder_validation(dir)
        files = get_files(dir)
        prefixes = [MODEL_FILE_PREFIX] + ([LAYER_FILE_PREFIX, f"{LAYER_FILE_PREFIX}01"] if pipeline_parallel else [])
        for prefix in prefixes:
            assert get_files_with_prefix(files, prefix), \
                f"{dir} seems a bogus DeepSpeed checkpoint folder: Cannot find {prefix}* files in there."


def _checkpoint_parallel_metadata(mpu: object) -> dict[str, dict[str, int]]:
    """The model states' ``checkpoint_parallel_dimensions`` entry for a run whose model-parallel unit is ``mpu``
    (DeepSpeed's ``runtime.engine`` helper): its pipeline and tensor degrees, 1 without an mpu, each read by the
    first of the method names DeepSpeed's backward-compatible helpers try."""
    def degree(names: tuple[str, ...]) -> int:
        if mpu is None:
            return 1
        for name in names:
            if hasattr(mpu, name):
                return int(getattr(mpu, name)())
        return 1

    return {CHECKPOINT_PARALLEL_DIMS: {
        CHECKPOINT_PP_DEGREE: degree(("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")),
        CHECKPOINT_TP_DEGREE: degree(("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                                      "get_model_parallel_world_size"))}}


def _aggregate_autoep_zero12_metadata(model_state_metadata: list[tuple[str, dict[str, Any]]]
                                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
    """From :class:`DeepSpeedCheckpoint`'s ``model_state_metadata``: each file's parameter shapes, the AutoEP
    layers of all files (one entry per expert prefix; the same prefix described two ways is refused) and the
    expert-ordering flag (every file must agree). Malformed entries raise ``RuntimeError`` naming the file."""
    shapes_by_file, by_prefix, source_of, ordering = [], {}, {}, {}
    for path, metadata in model_state_metadata:
        shapes = metadata[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {path}.")
        shapes_by_file.append(shapes)
        layers = metadata[AUTOEP_LAYERS_KEY]
        if layers is not None:
            if not isinstance(layers, list):
                raise RuntimeError(f"AutoEP metadata must be a list in {path}.")
            for layer in layers:
                if not isinstance(layer, dict):
                    raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {path}.")
                prefix = layer.get(AUTOEP_ZERO12_REQUIRED_FIELDS[0])
                if not isinstance(prefix, str) or not prefix:
                    raise RuntimeError(f"AutoEP expert_key_prefix must be a non-empty string in {path}.")
                if prefix in by_prefix and by_prefix[prefix] != layer:
                    raise RuntimeError(f"Conflicting AutoEP metadata for expert_key_prefix {prefix!r} in "
                                       f"{source_of[prefix]} and {path}.")
                by_prefix.setdefault(prefix, layer)
                source_of.setdefault(prefix, path)
        config = metadata["ds_config"]
        if not isinstance(config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {path}.")
        flag = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(flag, bool):
            raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean in {path}.")
        ordering[path] = flag
    if len(set(ordering.values())) != 1:
        raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across model-state "
                           f"files: {ordering}")
    return shapes_by_file, list(by_prefix.values()) or None, next(iter(ordering.values()))
