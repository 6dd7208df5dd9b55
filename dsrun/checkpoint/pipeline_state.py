"""A pipeline checkpoint read as one layout-free state, and the one mapping between pipeline and layer names.

A ``PipelineModule`` registers a layer's parameters under its global index (``"3.fc.weight"``) and a tied
layer's under its key (``"tied_modules.embed.weight"``). The *layer name* of a parameter is what a dense
model made of the same layers in order (an ``nn.Sequential``, a tied module registered once, at the first
index of its key) calls it: ``"3.fc.weight"`` unchanged, ``"tied_modules.embed.weight"`` -> ``"0.weight"``
when the key's first layer is layer 0. Universal checkpoints name parameters by layer name, so one converted
from a pipeline run loads into a pipeline at any number of stages and into the dense model, and one converted
from the dense model loads into a pipeline (:func:`to_layer_name` / :func:`to_pipeline_name`, used both ways).

Reading a pipeline checkpoint: every saved stage's ZeRO state is merged by parameter name
(:func:`merge_stages`; a resharded pipeline load reads only its ranges of them instead,
:class:`.partial_state.PartialStagesState`), and the per-layer files become one module state dict by layer name
(:func:`layer_module_state`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import deepspeed_format, layout, partial_state, reshard
from .safe_load import load_file
from .saved_tag import optim_files

PIPELINE_KEY = "pipeline"
TIED_PREFIX = "tied_modules."
_LAYER_FILE = re.compile(r"^layer_(\d+)(-model_(\d+))?-model_states\.pt$")


def to_layer_name(name: str, tied_first: dict[str, int]) -> str:
    """The layer name of pipeline parameter ``name`` (``tied_first``: each tied key's first layer index)."""
    if not name.startswith(TIED_PREFIX):
        return name
    key, _, rest = name[len(TIED_PREFIX):].partition(".")
    if key not in tied_first:
        raise KeyError(f"{name}: tied key {key!r} is not one of the model's ({sorted(tied_first)})")
    return f"{tied_first[key]}.{rest}"


def to_pipeline_name(name: str, tied_first: dict[str, int]) -> str:
    """The inverse of :func:`to_layer_name`."""
    index, _, rest = name.partition(".")
    for key, first in tied_first.items():
        if index == str(first):
            return f"{TIED_PREFIX}{key}.{rest}"
    return name


class NameMap:
    """Pipeline names <-> universal names: the layer name, or the dense model's own name where the
    ``PipelineModule`` declares one (``module.dense_names``: ``{layer name: dense name}``, e.g. the built-in
    GPT's ``2.attn.c_attn.weight`` -> ``transformer.h.0.attn.c_attn.weight``)."""

    def __init__(self, tied_first: dict[str, int], dense: dict[str, str] | None = None):
        self.tied_first = tied_first
        self.dense = dict(dense or {})
        self.layer_of = {v: k for k, v in self.dense.items()}

    def universal(self, pipeline_name: str) -> str:
        layer = to_layer_name(pipeline_name, self.tied_first)
        return self.dense.get(layer, layer)

    def pipeline(self, universal_name: str) -> str:
        return to_pipeline_name(self.layer_of.get(universal_name, universal_name), self.tied_first)

    def layer(self, universal_name: str) -> str:
        """The layer name of a universal name (module state keys)."""
        return self.layer_of.get(universal_name, universal_name)


def saved_slices(tag_dir: Path) -> list[dict[str, Any]]:
    """Every saved stage's model states file (``mp_rank_XX_model_states.pt``), in slice order; a stage saved at
    ZeRO stage 0 keeps its optimizer state there, which is left unread (a resharded load reads its ranges of it,
    :class:`.partial_state.PartialStagesState`; :func:`stage_optimizer_states` all of it)."""
    out, index = [], 0
    while (tag_dir / layout.model_states_name(0, 0, mp_rank=index)).is_file():
        out.append(partial_state.model_states_without_parameters(tag_dir / layout.model_states_name(
            0, 0, mp_rank=index), set()))
        index += 1
    if not out:
        raise FileNotFoundError(f"{tag_dir}: no mp_rank_XX_model_states.pt (not a checkpoint?)")
    return out


def is_pipeline_states(model_states: dict[str, Any]) -> bool:
    return model_states.get("module") is None and PIPELINE_KEY in (model_states.get("dsrun") or {})


def tied_layers(slice_states: dict[str, Any], tag_dir: Path) -> dict[str, list[int]]:
    """Each tied key's layer indices, as the saving run recorded them."""
    meta = slice_states["dsrun"][PIPELINE_KEY]
    if "tied" not in meta:
        raise ValueError(f"{tag_dir}: this pipeline checkpoint does not record its tied layers (saved by an older "
                         "dsrun); load it into a PipelineModule and save it again to convert it")
    return {key: [int(i) for i in indices] for key, indices in meta["tied"].items()}


def first_layers(tied: dict[str, list[int]]) -> dict[str, int]:
    """Each tied key's first layer index (where the layer name of a tied parameter points)."""
    return {key: min(indices) for key, indices in tied.items()}


def stage_optimizer_states(tag_dir: Path, slice_states: dict[str, Any], slice_rank: int,
                           bf16: bool) -> list[dict[str, Any]]:
    """The optimizer state dicts of one saved stage, one per saved data-parallel rank (stage 0: the one in its
    model states file, read whole here)."""
    if int(slice_states["dsrun"]["zero_stage"]) == 0:
        partial_state.read_stage0_state(tag_dir / layout.model_states_name(0, 0, mp_rank=slice_rank), slice_states)
        return [slice_states[partial_state.STAGE0_KEY]]
    return [deepspeed_format.load_zero_state(p) for p in optim_files(
        tag_dir, int(slice_states.get("dp_world_size", 1)), bf16, mp_rank=slice_rank)]


def merge_stages(tag_dir: Path, slices: list[dict[str, Any]], bf16: bool) -> reshard.FullOptimizerState:
    """One full optimizer state, by pipeline parameter name, over every saved stage."""
    full = reshard.FullOptimizerState()
    for slice_rank, sd in enumerate(slices):
        if sd.get("param_shapes") is None:
            continue
        part = reshard.merge_rank_states(stage_optimizer_states(tag_dir, sd, slice_rank, bf16),
                                         int(sd["dsrun"]["zero_stage"]), sd["param_shapes"])
        full.fp32.update(part.fp32)
        full.moments.update(part.moments)
        full.param_group_of.update(part.param_group_of)
        for gi, scalars in part.group_scalars.items():
            full.group_scalars.setdefault(gi, scalars)
        full.param_groups = full.param_groups or part.param_groups
        full.precision = full.precision or part.precision
    return full


def layer_module_state(tag_dir: Path, tied: dict[str, list[int]]) -> dict[str, Any]:
    """The module state of the whole model by layer name, from the per-layer files (model rank 0's copy of
    a layer saved per model rank; a tied module's state from its key's first layer)."""
    tied_later = {i for indices in tied.values() for i in indices} - set(first_layers(tied).values())
    files: dict[int, Path] = {}
    for path in sorted(tag_dir.iterdir()):
        match = _LAYER_FILE.match(path.name)
        if match and (match.group(3) is None or int(match.group(3)) == 0):
            files[int(match.group(1))] = path
    out: dict[str, Any] = {}
    for index in sorted(files):
        if index in tied_later:
            continue
        out.update({f"{index}.{k}": v for k, v in load_file(files[index]).items()})
    return out

