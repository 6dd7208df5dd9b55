"""Checkpoints of a model split over tensor-parallel ranks (AutoTP training, :mod:`dsrun.tensor_parallel`).

Each tensor-parallel rank writes its own files, as DeepSpeed names them: ``mp_rank_<t>_model_states.pt`` (its
slice of every split parameter, the whole others) and ``zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt``. The
model states hold ``mp_world_size`` and dsrun's ``tensor_parallel`` entry: for each split parameter the
dimension it was cut along and its number of fused parts (GPT-2's ``c_attn`` is q|k|v: each rank holds its
heads of each part). With that, :func:`merge_module_states` (and ``zero_to_fp32`` for the fp32 masters) puts the ranks' slices back together and
:func:`slice_dim` cuts a whole tensor for another degree.

A load at the degree the checkpoint was saved at reads the rank's own files (a bit-exact resume). A load at
another degree (TP=2 saved, TP=1 loaded) merges the module and re-cuts it for the live ranks; the ZeRO masters
then follow the loaded weights and the optimizer state is not carried (it is refused unless the load asks for
the weights only). :func:`merge_checkpoint` is the conversion: a whole model's state dict from a TP checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dsrun.utils.zero_to_fp32 import merge_slices

from . import layout
from .safe_load import load_file


def slice_dim(tensor: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice along ``dim`` of each of ``parts`` equal blocks of ``tensor``, concatenated."""
    moved = tensor.movedim(dim, 0)
    blocks = moved.reshape(parts, moved.shape[0] // parts, *moved.shape[1:])
    piece = blocks.shape[1] // size
    cut = blocks[:, rank * piece:(rank + 1) * piece].reshape(-1, *moved.shape[1:])
    return cut.movedim(0, dim).contiguous()


def splits_of(model_states: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{name: (dim, parts)}`` of a model states dict saved under AutoTP ({} otherwise)."""
    entry = (model_states.get("dsrun") or {}).get("tensor_parallel") or {}
    return {name: (int(cut[0]), int(cut[1])) for name, cut in (entry.get("splits") or {}).items()}


def saved_degree(model_states: dict[str, Any]) -> int:
    return int(model_states.get("mp_world_size", 1) or 1)


def merge_module_states(states: list[dict[str, Any]], splits: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """The whole module state from every tensor-parallel rank's (in rank order)."""
    merged = dict(states[0])
    for name, (dim, parts) in splits.items():
        if name in merged:
            merged[name] = merge_slices([s[name] for s in states], dim, parts)
    return merged


def merged_module_state(tag_dir: Path, model_states: dict[str, Any]) -> dict[str, Any]:
    """The whole module of a checkpoint saved over ``mp_world_size`` tensor-parallel ranks."""
    degree = saved_degree(model_states)
    states = [model_states["module"]] + [load_file(tag_dir / layout.model_states_name(0, 0, r))["module"]
                                         for r in range(1, degree)]
    return merge_module_states(states, splits_of(model_states))


def module_for_rank(tag_dir: Path, model_states: dict[str, Any], live: dict[str, tuple[int, int]], rank: int,
                    size: int) -> dict[str, Any]:
    """Tensor-parallel rank ``rank`` of ``size``'s module state (its split parameters ``live``) from a checkpoint
    saved at another degree: merged, then cut again."""
    whole = merged_module_state(tag_dir, model_states)
    for name, (dim, parts) in live.items():
        if name in whole:
            whole[name] = slice_dim(whole[name], dim, parts, rank, size)
    return whole


def merge_checkpoint(checkpoint_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The conversion to TP=1: the whole model's state dict (the model's dtype) of the checkpoint ``tag`` (None:
    the one ``latest`` names) under ``checkpoint_dir``, saved at any tensor-parallel degree; load it into the
    unsplit model with ``load_state_dict``."""
    root = Path(checkpoint_dir)
    name = tag if tag is not None else layout.read_latest(root)
    if name is None:
        raise FileNotFoundError(f"{root}: no 'latest' file; pass the tag")
    tag_dir = root / str(name)
    model_states = load_file(tag_dir / layout.model_states_name(0, 0, 0))
    return merged_module_state(tag_dir, model_states)
