"""Convert a dsrun ZeRO checkpoint (any stage, any number of ranks) to a universal checkpoint.

DeepSpeed's ``deepspeed/checkpoint/ds_to_universal.py``, with its arguments::

    python -m dsrun.checkpoint.ds_to_universal --input_folder ckpt/global_step100 --output_folder ckpt/global_step100_universal
    dsrun convert ds-to-universal ckpt/global_step100 ckpt/global_step100_universal

``--input_folder`` is one tag's folder. The saved ranks' optimizer files are merged into one value per
parameter (the fp32 master and each optimizer state, e.g. Adam's ``exp_avg``/``exp_avg_sq``), written one
folder per parameter (layout: :mod:`dsrun.checkpoint.universal_checkpoint`), next to a model states file whose
module holds the full weights. ``latest_universal`` beside the output folder names it, so an engine with
``"checkpoint": {"load_universal": true}`` loads it from the parent folder at any world size and stage. The
output appears only when complete (written under ``.<name>.staging``, then renamed).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from dsrun.utils import zero_to_fp32 as z2f

from . import atomic, layout, partial_state, pipeline_state, reshard
from . import tensor_parallel as tp
from .constants import CHECKPOINT_PARALLEL_DIMS, UNIVERSAL_CHECKPOINT_INFO
from .deepspeed_checkpoint import DeepSpeedCheckpoint, _aggregate_autoep_zero12_metadata
from .deepspeed_universal import (_filter_zero3_optim_files, _get_optim_files, _get_zero_stage, _inject_missing_state,
                                  convert_zero3)
from .safe_load import load_file
from .tp_slices import (_group_per_tp_shapes, _merge_zero_shards, _validate_autotp_conversion_support,
                        dump_param_fragment, merge_tp_slices)
from .tensor_parallel import TENSOR_PARALLEL_KEY
from .saved_tag import saved_stage, saved_world
from .universal_checkpoint import (CAT_DIM, FP32, LATEST_UNIVERSAL, OPTIMIZER_STATE, PARAM, PARAM_N_SUB_PARAMS, STEP,
                                   UNIVERSAL_DIR)

# DeepSpeed's names in its ds_to_universal module (the slice-file merge: tp_slices.py)
__all__ = ["DeepSpeedCheckpoint", "_aggregate_autoep_zero12_metadata", "_filter_zero3_optim_files",
           "_get_optim_files", "_get_zero_stage", "_group_per_tp_shapes", "_inject_missing_state", "_merge_zero_shards",
           "_validate_autotp_conversion_support", "ds_to_universal", "dump_param_fragment", "main", "merge_tp_slices",
           "parse_arguments"]


def _model_states_file(tag_dir: Path) -> Path:
    files = sorted(tag_dir.glob("*model_states.pt"), key=lambda p: z2f.natural_key(p.name))
    if not files:
        raise FileNotFoundError(f"{tag_dir}: no '*model_states.pt' file: pass one checkpoint tag's folder "
                                "(e.g. checkpoints/global_step100)")
    plain = tag_dir / layout.model_states_name(0, 0)
    return plain if plain.is_file() else files[0]


class _Source(reshard.StateSource, Protocol):
    """The saved state read for the conversion: also each parameter's param group."""

    param_group_of: dict[str, int]


def _pipeline_source(tag_dir: Path, say: Callable[[str], object], opened: contextlib.ExitStack
                     ) -> tuple[int, int, _Source, list[tuple[str, str]], list[dict[str, Any]],
                                dict[str, Any]]:
    """A pipeline checkpoint's ZeRO stage, data-parallel size, optimizer state read by range (by pipeline name),
    its parameters (pipeline name, universal name), their shapes and the module state, by universal name
    (:class:`.pipeline_state.NameMap`)."""
    slices = pipeline_state.saved_slices(tag_dir)
    tied = pipeline_state.tied_layers(slices[0], tag_dir)
    names = pipeline_state.NameMap(pipeline_state.first_layers(tied),
                                   slices[0]["dsrun"][pipeline_state.PIPELINE_KEY].get("dense_names"))
    stage, world = int(slices[0]["dsrun"]["zero_stage"]), saved_world(slices[0])
    if not any(sd.get("param_shapes") for sd in slices):
        raise ValueError(f"{tag_dir}: the checkpoint has no optimizer state (no param_shapes) to convert; "
                         "it was saved by an engine without optimizer")
    say(f"Converting pipeline checkpoint of {len(slices)} stage(s) x {world} data-parallel rank(s) at ZeRO-{stage} "
        f"in {tag_dir} to a universal checkpoint (parameters by layer name)")
    bf16 = any(tag_dir.glob("bf16_*optim_states.pt"))
    source = opened.enter_context(partial_state.PartialStagesState(tag_dir, slices, bf16))
    shapes: list[dict[str, Any]] = []
    params: dict[str, str] = {}
    for sd in slices:
        for gi, group in enumerate(sd.get("param_shapes") or []):
            while len(shapes) <= gi:
                shapes.append({})
            shapes[gi].update({names.universal(n): s for n, s in group.items()})
            params.update({n: names.universal(n) for n in group})
    module = {names.dense.get(k, k): v for k, v in pipeline_state.layer_module_state(tag_dir, tied).items()}
    return stage, world, source, list(params.items()), shapes, module


def _plain_source(tag_dir: Path, model_path: Path, model_states: dict[str, Any], say: Callable[[str], object],
                  out_dir: Path, opened: contextlib.ExitStack
                  ) -> tuple[int, int, _Source, list[tuple[str, str]], list[dict[str, Any]],
                             dict[str, Any]]:
    """A dense checkpoint's ZeRO stage, data-parallel size, optimizer state (every saved rank's files read by
    range; an AutoTP checkpoint's tensor-parallel ranks merged), its parameters, their shapes and its module."""
    shapes = model_states.get("param_shapes")
    if not shapes:
        raise ValueError(f"{model_path}: the checkpoint has no optimizer state (no param_shapes) to convert; "
                         "it was saved by an engine without optimizer")
    stage, world = saved_stage(model_states, tag_dir), saved_world(model_states)
    bf16 = any(tag_dir.glob("bf16_*optim_states.pt"))
    degree = tp.saved_degree(model_states)
    say(f"Converting ZeRO-{stage} checkpoint of {world} rank(s)" + (f" x {degree} tensor-parallel ranks" if
        degree > 1 else "") + f" in {tag_dir} to a universal checkpoint in {out_dir}")
    source: _Source
    if degree > 1:  # AutoTP: each split parameter read from every tensor-parallel rank's slice, by range
        source, shapes = tp.merged_optimizer_state(tag_dir, model_states, stage, world, bf16, opened)
        module = tp.merged_module_state(tag_dir, model_states)  # ZeRO-3's placeholders stay: filled from masters
    else:
        source = opened.enter_context(partial_state.saved_state(tag_dir, model_path, stage, world, shapes, False, bf16))
        module = dict(model_states["module"])
    return stage, world, source, [(n, n) for group in shapes for n in group], shapes, module


def _placeholders(module: dict[str, Any]) -> list[str]:
    """A stage-3 checkpoint's module entries saved empty (their values are the fp32 masters)."""
    return [name for name, value in module.items() if torch.is_tensor(value) and value.numel() == 0]


def _write_parameters(root: Path, source: _Source, params: list[tuple[str, str]],
                      shape_of: dict[str, torch.Size], splits: dict[str, tuple[int, tp.Parts]], module: dict[str, Any]
                      ) -> dict[str, int]:
    """One folder per parameter (its fp32 master and optimizer states, read from ``source`` one parameter at a
    time, so the conversion holds one parameter's state); a placeholder of ``module`` of that name becomes the
    master, in its saved dtype. Returns each written parameter's param group."""
    group_of: dict[str, int] = {}
    for name, written in params:
        if not source.has_master(name):
            continue
        shape = shape_of[written]
        value = torch.zeros(math.prod(shape))
        source.copy_range(name, None, 0, value)
        folder = root / written
        folder.mkdir()
        # DeepSpeed's keys: a TP-split parameter's dimension and its number of fused parts (GPT-2's q|k|v: 3)
        dim, parts = splits.get(written, (0, 1))
        count = tp.part_count(parts)
        cut = {CAT_DIM: dim, **({PARAM_N_SUB_PARAMS: count} if count > 1 else {})}
        atomic.save_torch({PARAM: value.view(shape), **cut}, folder / f"{FP32}.pt")
        if written in module and torch.is_tensor(module[written]) and module[written].numel() == 0:
            module[written] = value.view(shape).to(module[written].dtype)
        for key in sorted(source.moment_keys(name)):
            moment = torch.zeros(value.numel(), dtype=source.moment_dtype(name, key))
            source.copy_range(name, key, 0, moment)
            atomic.save_torch({PARAM: moment.view(shape), **cut}, folder / f"{key}.pt")
        group_of[written] = source.param_group_of.get(name, 0)
        step = source.group_scalars.get(group_of[written], {}).get(STEP)
        if step is not None:
            atomic.save_torch(step, folder / f"{STEP}.pt")
    return group_of


def ds_to_universal(input_folder: str, output_folder: str, verbose: bool = True) -> Path:
    """Write the universal form of the checkpoint tag folder ``input_folder`` to ``output_folder`` and point
    ``latest_universal`` (in ``output_folder``'s parent) at it; returns the output folder. The saved optimizer
    state is read by byte range, one parameter at a time (:mod:`.partial_state`), not merged in memory."""
    say = print if verbose else (lambda *_: None)
    tag_dir, out_dir = Path(input_folder), Path(output_folder)
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"--input_folder {tag_dir} is not a folder")
    model_path = _model_states_file(tag_dir)
    # a stage-0 save's optimizer state (in this file) is left unread: read by range below
    model_states = partial_state.model_states_without_parameters(model_path, set())
    with contextlib.ExitStack() as opened:
        if pipeline_state.is_pipeline_states(model_states):
            stage, world, source, params, shapes, module = _pipeline_source(tag_dir, say, opened)
        else:
            stage, world, source, params, shapes, module = _plain_source(tag_dir, model_path, model_states, say,
                                                                         out_dir, opened)
        shape_of = {name: torch.Size(shape) for group in shapes for name, shape in group.items()}
        staging = out_dir.parent / f".{out_dir.name}.staging"
        atomic.remove_tree(staging)
        root = staging / UNIVERSAL_DIR
        root.mkdir(parents=True)
        splits = tp.splits_of(model_states)
        group_of = _write_parameters(root, source, params, shape_of, splits, module)
        moment_keys = sorted({k for name, _ in params if source.has_master(name) for k in source.moment_keys(name)})
        meta = {"param_groups": source.param_groups, "group_scalars": source.group_scalars,
                "param_group_of": group_of, "precision": source.precision,
                "zero_stage": stage, "dp_world_size": world, "source": str(tag_dir)}
    atomic.save_torch(meta, root / OPTIMIZER_STATE)
    for alias, tied_to in (model_states.get("shared_params") or {}).items():  # a tied alias: its source's value
        if alias in _placeholders(module) and tied_to in module and module[tied_to].numel():
            module[alias] = module[tied_to].clone()
    empty = _placeholders(module)
    if empty:  # placeholders without masters (frozen parameters): their gathered fragments
        full = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag_dir.name)
        module.update({name: full[name].to(module[name].dtype).clone() for name in empty if name in full})

    universal_states = {k: v for k, v in model_states.items() if k not in ("optimizer", "frozen_param_fragments")}
    universal_states["module"] = module
    universal_states["param_shapes"] = shapes
    extras = dict(model_states.get("dsrun") or {})
    origin = {"zero_stage": stage, "dp_world_size": world}
    if pipeline_state.PIPELINE_KEY in extras:  # the layers are one module now, named by layer
        origin[pipeline_state.PIPELINE_KEY] = extras.pop(pipeline_state.PIPELINE_KEY)
        universal_states["mp_world_size"] = 1
    if splits:  # the module is whole now: a load cuts it for its own tensor-parallel degree
        origin[TENSOR_PARALLEL_KEY] = {**extras.pop(TENSOR_PARALLEL_KEY), "degree": tp.saved_degree(model_states)}
        universal_states["mp_world_size"] = 1
        universal_states.pop(CHECKPOINT_PARALLEL_DIMS, None)  # one whole module now
    universal_states["dsrun"] = {**extras, "universal_from": origin}
    atomic.save_torch(universal_states, staging / layout.model_states_name(0, 0))

    for rank in range(world):  # the 1-bit optimizers' per-rank error buffers, re-cut at load like a reshard
        rank_file = tag_dir / layout.rank_states_name(rank)
        if rank_file.is_file():
            shutil.copyfile(rank_file, staging / rank_file.name)
    elements = sum(math.prod(s) for s in shape_of.values())
    atomic.fsync_dir(staging)
    atomic.remove_tree(out_dir)
    staging.rename(out_dir)
    atomic.write_text(out_dir.parent / LATEST_UNIVERSAL, out_dir.name)
    say(f"Wrote {len(group_of)} parameters ({elements} elements) with states {moment_keys or 'none'} to {out_dir}")
    return out_dir


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Convert a ZeRO checkpoint tag folder to a universal checkpoint.")
    parser.add_argument("--input_folder", type=str, required=True, help="the ZeRO checkpoint's tag folder")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal checkpoint folder to write")
    # DeepSpeed's tuning flags: its conversion extracts and merges in worker processes; dsrun merges each
    # rank's file in one pass, so they change nothing here and are accepted so DeepSpeed's command lines run
    parser.add_argument("--num_extract_workers", type=int, default=4, help="accepted for DeepSpeed compatibility")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="accepted for DeepSpeed compatibility")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted for DeepSpeed compatibility "
                        "(dsrun writes no temporary slice files)")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="a DeepSpeed-written ZeRO-3 "
                        "AutoTP checkpoint: warn, not fail, when a universal_checkpoint_info pattern names no "
                        "parameter (dsrun's own checkpoints record their splits: no patterns)")
    parser.add_argument("--inject_missing_state", action="store_true", help="a DeepSpeed-written ZeRO-1/2 "
                        "checkpoint without universal_checkpoint_info: give it a minimal one")
    return parser.parse_args(argv)


def _written_by_dsrun(tag_dir: Path) -> bool:
    """Whether the tag folder's model states carry dsrun's entry (only the file's index is read)."""
    try:
        return "dsrun" in load_file(_model_states_file(tag_dir), map_location="meta")
    except FileNotFoundError:
        return False


def main(args: argparse.Namespace | None = None) -> None:
    """DeepSpeed's entry point: ``main(args)`` with ``args.input_folder`` and ``args.output_folder``. A folder
    dsrun wrote is converted by :func:`ds_to_universal`. One DeepSpeed wrote goes through DeepSpeed's steps:
    its ZeRO stage from the optimizer files; at stage 3 DeepSpeed's conversion of the ``tp x dp`` grid
    (:func:`.deepspeed_universal.convert_zero3`); at stages 1-2 its ``universal_checkpoint_info`` (a minimal one
    injected with ``--inject_missing_state``) is checked for AutoTP layouts no merge can undo before
    :func:`ds_to_universal` converts it."""
    args = parse_arguments() if args is None else args
    if not _written_by_dsrun(Path(args.input_folder)):
        try:
            optim_files = _get_optim_files(args.input_folder)
        except FileNotFoundError:  # a stage-0 save: its optimizer state is in the model states (read below)
            ds_to_universal(args.input_folder, args.output_folder)
            return
        zero3_files = _filter_zero3_optim_files(optim_files)
        if _get_zero_stage(zero3_files or optim_files) > 2:
            convert_zero3(args.input_folder, args.output_folder, zero3_files or optim_files,
                          getattr(args, "strict", True), getattr(args, "keep_temp_folder", False))
            return
        checkpoint = DeepSpeedCheckpoint(args.input_folder)
        if getattr(args, "inject_missing_state", False):
            _inject_missing_state(checkpoint)
        info = checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
        if info is not None:
            _validate_autotp_conversion_support(info)
    ds_to_universal(args.input_folder, args.output_folder)


if __name__ == "__main__":
    main()
