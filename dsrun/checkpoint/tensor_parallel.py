"""Checkpoints of a model split over tensor-parallel ranks (AutoTP training, :mod:`dsrun.tensor_parallel`).

Each tensor-parallel rank writes its own files, as DeepSpeed names them: ``mp_rank_<t>_model_states.pt`` (its
slice of every split parameter, the whole others) and ``zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt``. The
model states hold ``mp_world_size`` and dsrun's ``tensor_parallel`` entry: for each split parameter the
dimension it was cut along and its number of fused parts (GPT-2's ``c_attn`` is q|k|v: each rank holds its
heads of each part), or for a cut that is not the even one (unequal parts, grains) its widths, per part each rank's
length (:data:`Parts`). With that, :func:`merge_module_states` (and ``zero_to_fp32`` for the fp32 masters) puts the ranks' slices back together and
:func:`slice_dim` cuts a whole tensor for another degree.

A load at the degree the checkpoint was saved at reads the rank's own files (a bit-exact resume). A load at
another degree (TP=2 saved, TP=1 loaded) merges the module and re-cuts it for the live ranks; the ZeRO masters
then follow the loaded weights and the optimizer state is not carried (it is refused unless the load asks for
the weights only). :func:`merge_checkpoint` is the conversion: a whole model's state dict from a TP checkpoint.

The optimizer state crosses degrees through a universal checkpoint: :func:`merged_optimizer_state` puts each
tensor-parallel rank's merged ZeRO state together (split parameters concatenated along their split dimension,
per fused part, as DeepSpeed's ``ds_to_universal`` merges TP slices; whole ones taken from rank 0), and
:class:`RankSlices` reads a tensor-parallel rank's slice of each split parameter back out of the universal
folder's whole values, by element ranges, so the load stays a partial read.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from dsrun.utils.errors import Problem, UserError
from dsrun.utils.zero_to_fp32 import merge_slices

from . import layout, reshard
from .safe_load import load_file
from .autotp_meta import Parts, Widths, rank_widths, shard_bounds
from .partial_state import model_states_without_parameters, saved_state
from .universal_checkpoint import is_universal


def part_count(parts: Parts) -> int:
    """How many fused parts a split has."""
    return parts if isinstance(parts, int) else len(parts)


def as_parts(value: object) -> Parts:
    """A checkpoint entry's parts (JSON: an int or a list of lists) as :data:`Parts`."""
    if isinstance(value, (list, tuple)):
        return tuple(tuple(int(w) for w in part) for part in value)
    return int(value)


def slice_dim(tensor: torch.Tensor, dim: int, parts: Parts, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice along ``dim``: of each of ``parts`` equal blocks of ``tensor`` its
    :func:`shard_bounds`, or with explicit widths its width of each part, concatenated."""
    moved = tensor.movedim(dim, 0)
    if not isinstance(parts, int):
        pieces, start = [], 0
        for part in parts:
            pieces.append(moved[start + sum(part[:rank]):start + sum(part[:rank + 1])])
            start += sum(part)
        return torch.cat(pieces).movedim(0, dim).contiguous()
    blocks = moved.reshape(parts, moved.shape[0] // parts, *moved.shape[1:])
    start, length = shard_bounds(blocks.shape[1], rank, size)
    cut = blocks[:, start:start + length].reshape(-1, *moved.shape[1:])
    return cut.movedim(0, dim).contiguous()


TENSOR_PARALLEL_KEY = "tensor_parallel"  # the model states' ``dsrun`` entry that records the splits


def splits_of(model_states: dict[str, Any]) -> dict[str, tuple[int, Parts]]:
    """``{name: (dim, parts)}`` of a model states dict saved under AutoTP ({} otherwise)."""
    entry = (model_states.get("dsrun") or {}).get(TENSOR_PARALLEL_KEY) or {}
    return {name: (int(cut[0]), as_parts(cut[1])) for name, cut in (entry.get("splits") or {}).items()}


def saved_degree(model_states: dict[str, Any]) -> int:
    return int(model_states.get("mp_world_size", 1) or 1)


def merge_module_states(states: list[dict[str, Any]], splits: dict[str, tuple[int, Parts]]) -> dict[str, Any]:
    """The whole module state from every tensor-parallel rank's (in rank order)."""
    merged = dict(states[0])
    for name, (dim, parts) in splits.items():
        if name in merged and merged[name].numel():  # a ZeRO-3 placeholder stays empty: its master is the value
            merged[name] = merge_slices([s[name] for s in states], dim, parts)
    return merged


def merged_module_state(tag_dir: Path, model_states: dict[str, Any]) -> dict[str, Any]:
    """The whole module of a checkpoint saved over ``mp_world_size`` tensor-parallel ranks."""
    degree = saved_degree(model_states)
    # the other ranks' modules (a stage-0 save's optimizer state in the same files is left unread)
    states = [model_states["module"]] + [
        model_states_without_parameters(layout.rank_model_states(tag_dir, r), set())["module"]
        for r in range(1, degree)]
    return merge_module_states(states, splits_of(model_states))


def module_for_rank(tag_dir: Path, model_states: dict[str, Any], live: dict[str, tuple[int, Parts]], rank: int,
                    size: int) -> dict[str, Any]:
    """Tensor-parallel rank ``rank`` of ``size``'s module state (its split parameters ``live``) from a checkpoint
    saved at another degree: merged, then cut again."""
    whole = merged_module_state(tag_dir, model_states)
    for name, (dim, parts) in live.items():
        if name in whole:
            whole[name] = slice_dim(whole[name], dim, parts, rank, size)
    return whole


def module_for_live_degree(tag_dir: Path, model_states: dict[str, Any], live: dict[str, tuple[int, Parts]], rank: int,
                           size: int, with_optimizer: bool) -> tuple[dict[str, Any], bool]:
    """The module state tensor-parallel rank ``rank`` of ``size`` (its split parameters ``live``) loads from
    ``model_states``, and whether its ZeRO masters must follow that module (the optimizer state does not carry
    over). At the saved degree: the saved module, False. At another: merged and cut again; the optimizer state of
    a TP checkpoint does not carry over (refused, unless ``with_optimizer`` is False), a universal folder's does
    (:class:`RankSlices`: the masters are read from it, False)."""
    degree = saved_degree(model_states)
    if degree == size:
        return model_states["module"], False
    universal = is_universal(tag_dir)
    if with_optimizer and not universal:
        raise UserError(Problem("load_checkpoint", f"{tag_dir.name} was saved over {degree} tensor-parallel ranks; "
                                f"this run has {size}: its optimizer state does not carry over", "load_module_only="
                                "True (or load_optimizer_states=False) loads the weights; or convert it with "
                                "ds_to_universal and load that (checkpoint.load_universal: true)"))
    if not universal and any(torch.is_tensor(v) and not v.numel() for k, v in model_states["module"].items()
                             if k in splits_of(model_states)):
        raise UserError(Problem("load_checkpoint", f"{tag_dir.name} is a ZeRO-3 checkpoint over {degree} "
                                f"tensor-parallel ranks; this run has {size}: its module holds no weights (the ZeRO-3 "
                                "masters do)", "convert it with ds_to_universal and load that "
                                "(checkpoint.load_universal: true)"))
    return module_for_rank(tag_dir, model_states, live, rank, size), not (universal and with_optimizer)


def merge_checkpoint(checkpoint_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The conversion to TP=1: the whole model's state dict (the model's dtype) of the checkpoint ``tag`` (None:
    the one ``latest`` names) under ``checkpoint_dir``, saved at any tensor-parallel degree; load it into the
    unsplit model with ``load_state_dict``."""
    root = Path(checkpoint_dir)
    name = tag if tag is not None else layout.read_latest(root)
    if name is None:
        raise FileNotFoundError(f"{root}: no 'latest' file; pass the tag")
    tag_dir = root / str(name)
    model_states = load_file(layout.rank_model_states(tag_dir, 0))
    return merged_module_state(tag_dir, model_states)


def merged_optimizer_state(tag_dir: Path, model_states: dict[str, Any], stage: int, world: int, bf16: bool,
                           opened: contextlib.ExitStack) -> tuple[MergedRanks, list[dict[str, Any]]]:
    """The whole model's optimizer state (fp32 masters, per-element states, scalars) of a checkpoint saved over
    ``mp_world_size`` tensor-parallel ranks, each with ``world`` data-parallel ranks at ZeRO ``stage`` (0-3), and
    its param groups' whole shapes. Nothing is merged in memory: each tensor-parallel rank's saved files are
    opened for reads by range (``opened``, an ExitStack, closes them) and :class:`MergedRanks` reads each split
    parameter's whole value from the ranks' slices, a whole one from rank 0."""
    splits = splits_of(model_states)
    degree = saved_degree(model_states)
    paths = [layout.rank_model_states(tag_dir, t) for t in range(degree)]
    shapes = [list(model_states["param_shapes"])] + [list(load_file(paths[t], map_location="meta")["param_shapes"])
                                                     for t in range(1, degree)]
    sources = [opened.enter_context(saved_state(tag_dir, paths[t], stage, world, shapes[t], False, bf16, mp_rank=t))
               for t in range(degree)]
    whole_shapes = [dict(group) for group in shapes[0]]
    for gi, group in enumerate(whole_shapes):
        for name in group:
            if name in splits:
                dim, parts = splits[name]
                rank_shapes = [torch.Size(shapes[t][gi][name]) for t in range(degree)]
                whole = list(rank_shapes[0])
                whole[dim] = sum(s[dim] for s in rank_shapes)
                group[name] = torch.Size(whole)
    merged = MergedRanks(sources, splits, {n: torch.Size(s) for g in whole_shapes for n, s in g.items()})
    return merged, whole_shapes


class RankSlices:
    """A :class:`.reshard.StateSource` of whole values (a universal folder's) seen as tensor-parallel rank
    ``rank`` of ``size``: each split parameter (``splits``, ``{name: (dim, parts)}``) is that rank's
    :func:`slice_dim` of the whole value, whose shape ``whole_shapes`` gives; reads go to ``source`` by element
    ranges, one per run of the slice that is contiguous in the whole value."""

    def __init__(self, source: reshard.StateSource, whole_shapes: list[dict[str, Any]],
                 splits: dict[str, tuple[int, Parts]], rank: int, size: int) -> None:
        self.source, self.splits, self.rank, self.size = source, splits, rank, size
        self.shapes = {name: torch.Size(shape) for group in whole_shapes for name, shape in group.items()}
        self.group_scalars, self.param_groups = source.group_scalars, source.param_groups
        self.precision = source.precision

    def has_master(self, name: str) -> bool:
        return self.source.has_master(name)

    def moment_keys(self, name: str) -> set[str]:
        return self.source.moment_keys(name)

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self.source.moment_dtype(name, key)

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        if name not in self.splits:
            self.source.copy_range(name, key, full_offset, out)
            return
        dim, parts = self.splits[name]
        shape = self.shapes[name]
        widths = rank_widths(shape[dim], parts, self.size)
        inner = math.prod(shape[dim + 1:])
        # for each index before dim, the rank's piece of each part: (start in the whole row, length), in elements
        pieces, begin = [], 0
        for part in widths:
            pieces.append(((begin + sum(part[:self.rank])) * inner, part[self.rank] * inner))
            begin += sum(part)
        row = sum(length for _, length in pieces)  # the slice's elements per index before dim
        end = full_offset + out.numel()
        for outer in range(full_offset // row if row else 0, -(-end // row) if row else 0):
            at = outer * row  # where this row of the slice starts, in the slice
            for whole_start, length in pieces:
                lo, hi = max(full_offset, at), min(end, at + length)
                if lo < hi:
                    self.source.copy_range(name, key, outer * shape[dim] * inner + whole_start + lo - at,
                                           out[lo - full_offset:hi - full_offset])
                at += length


def whole_runs(shape: torch.Size, dim: int, widths: Widths, rank: int, start: int, end: int
               ) -> list[tuple[int, int, int]]:
    """Where tensor-parallel rank ``rank``'s slice (``widths`` per fused part along ``dim``) lies in the whole
    value of ``shape``, restricted to the whole value's elements ``[start, end)``: ``(whole offset, slice offset,
    length)`` per contiguous run, in order."""
    inner = math.prod(shape[dim + 1:])
    row = shape[dim] * inner  # the whole value's elements per index before dim
    mine = sum(part[rank] for part in widths) * inner  # the slice's
    runs = []
    for outer in range(start // row if row else 0, -(-end // row) if row else 0):
        at, taken = outer * row, outer * mine
        for part in widths:
            lo = at + sum(part[:rank]) * inner
            hi = lo + part[rank] * inner
            if max(lo, start) < min(hi, end):
                runs.append((max(lo, start), taken + max(lo, start) - lo, min(hi, end) - max(lo, start)))
            at += sum(part) * inner
            taken += part[rank] * inner
    return runs


class MergedRanks:
    """The whole model's optimizer state of a checkpoint saved over several tensor-parallel ranks, as a
    :class:`.reshard.StateSource`, without merging anything in memory: ``sources[t]`` is rank ``t``'s saved state
    (its files read by range, :mod:`.partial_state`); a split parameter's whole-value range is read from each
    rank's slice where it lies (:func:`whole_runs`), a whole parameter from rank 0 (every rank holds the same)."""

    def __init__(self, sources: list[Any], splits: dict[str, tuple[int, Parts]],
                 whole_shapes: dict[str, torch.Size]) -> None:
        self.sources, self.splits, self.shapes = sources, splits, whole_shapes
        first = sources[0]
        self.group_scalars, self.param_groups, self.precision = first.group_scalars, first.param_groups, first.precision
        self.param_group_of = first.param_group_of

    def has_master(self, name: str) -> bool:
        return self.sources[0].has_master(name)

    def moment_keys(self, name: str) -> set[str]:
        return self.sources[0].moment_keys(name)

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self.sources[0].moment_dtype(name, key)

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        if name not in self.splits:
            self.sources[0].copy_range(name, key, full_offset, out)
            return
        dim, parts = self.splits[name]
        shape = self.shapes[name]
        widths = rank_widths(shape[dim], parts, len(self.sources))
        end = full_offset + out.numel()
        for rank, source in enumerate(self.sources):
            for whole_at, slice_at, length in whole_runs(shape, dim, widths, rank, full_offset, end):
                source.copy_range(name, key, slice_at, out[whole_at - full_offset:whole_at - full_offset + length])


def universal_rank_source(source: reshard.StateSource, whole_shapes: list[dict[str, Any]] | None,
                          splits: dict[str, tuple[int, Parts]], rank: int, size: int) -> reshard.StateSource:
    """``source`` (whole values) as tensor-parallel rank ``rank`` of ``size`` reads it: itself at one rank."""
    if size <= 1 or not splits:
        return source
    if not whole_shapes:
        raise RuntimeError("a universal checkpoint without 'param_shapes' cannot be cut for tensor-parallel ranks")
    return RankSlices(source, whole_shapes, splits, rank, size)
