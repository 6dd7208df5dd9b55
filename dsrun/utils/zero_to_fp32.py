#!/usr/bin/env python
"""Consolidate a dsrun (DeepSpeed-layout) ZeRO checkpoint into one fp32 state dict.

This file needs only PyTorch (and ``safetensors`` for ``--safe_serialization``): ``save_checkpoint`` copies
it next to the tag folders so a checkpoint can be converted where dsrun is not installed::

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]
                           [--safe_serialization]

As DeepSpeed's current converter, it writes a folder: ``pytorch_model.bin`` (``model.safetensors``), or past
``--max_shard_size`` the shards ``pytorch_model-00001-of-0000N.bin`` ... and ``pytorch_model.bin.index.json``
(``model.safetensors.index.json``). An OUTPUT ending in ``.bin``, ``.pt``, ``.pth`` or ``.safetensors`` is
written as that one file, as DeepSpeed's converter did before (0.15 and older).

``CHECKPOINT_DIR`` is the folder holding ``latest`` and the ``global_step*`` tag folders. Stages 0, 1, 2 and
3 are understood. The fp32 values are the optimizer's master weights, so a bf16/fp16 run converts to the
exact fp32 weights the optimizer was stepping. Of each file only the master weights (and the buffers) are
read, by their byte offsets, so memory stays near the output and the optimizer moments are never read.

Tied weights (``shared_params`` in the model states): the alias key holds the very same tensor as its source, so
``torch.save`` stores it once. safetensors cannot store two names for one tensor: the alias key is left out and
the file's metadata ``dsrun_shared_params`` (JSON ``{alias: source}``) names it; re-tie after loading or load with
``strict=False`` into a model whose weights are tied.

Every file is read with ``torch.load(weights_only=True)``: a checkpoint cannot run code while loading.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

OPTIM_SUFFIX = "optim_states.pt"
MODEL_SUFFIX = "model_states.pt"
LATEST = "latest"
SHARED_PARAMS_METADATA = "dsrun_shared_params"
BASE_OPTIMIZER_KEYS = ("base_optimizer_state", "optimizer_state_dict")


# --- the layout of ZeRO master weights (shared with dsrun.checkpoint.reshard) --------------------------------
@dataclass(frozen=True)
class Slot:
    """``length`` elements of parameter ``name``, from ``full_offset`` in its flattened full value, sit at
    ``master_offset`` in one rank's flat master tensor."""

    name: str
    master_offset: int
    full_offset: int
    length: int


def alignment_paddings(paddings: list[list[int]] | None) -> list[list[int]] | None:
    """DeepSpeed's ``param_alignment_paddings`` (per master, the zeros after each parameter) as int lists; None
    where nothing is padded (saved without ``zero_optimization.parameter_alignment``): the packed layout."""
    padded = bool(paddings) and any(int(p) for group in paddings for p in group)
    return [[int(p) for p in group] for group in paddings] if padded else None


def master_slots(stage: int, world_size: int, rank: int, group_shapes: list[dict[str, Any]],
                 paddings: list[list[int]] | None = None) -> tuple[list[list[Slot]], list[int]]:
    """Where each parameter's elements sit in rank ``rank``'s master tensors, one list per master tensor
    (a param group at stages 0-2, a sub-group at stage 3), and each master tensor's padded length.

    Stages 0-2 flatten a group end to end (stages 1-2 pad it to a multiple of ``2 * world_size`` and give
    rank r the r-th equal slice; ``paddings``, DeepSpeed's ``param_alignment_paddings``: the zeros after each
    parameter); stage 3 splits every parameter into ``ceil(numel / world)`` per rank, this rank's end to end."""
    slots: list[list[Slot]] = []
    lengths: list[int] = []
    for gi, shapes in enumerate(group_shapes):
        numels = [(name, math.prod(shape)) for name, shape in shapes.items()]
        gaps = paddings[gi] if paddings is not None and gi < len(paddings) else [0] * len(numels)
        group_slots = []
        if stage == 3:
            offset = 0
            for name, numel in numels:
                part = -(-numel // world_size) if numel else 0
                length = max(0, min(part, numel - rank * part))
                if length:
                    group_slots.append(Slot(name, offset, rank * part, length))
                offset += part
            lengths.append(offset)
        else:
            total = sum(n for _, n in numels) + sum(gaps)
            if stage == 0:
                lo, hi = 0, max(total, 1)
            else:
                part = -(-max(total, 1) // (2 * world_size)) * 2  # padded to a multiple of 2 * world_size
                lo, hi = rank * part, (rank + 1) * part
            offset = 0
            for (name, numel), gap in zip(numels, gaps, strict=True):  # a mismatch: ValueError
                start, end = max(offset, lo), min(offset + numel, hi)
                if end > start:
                    group_slots.append(Slot(name, start - lo, start - offset, end - start))
                offset += numel + gap
            lengths.append(hi - lo)
        slots.append(group_slots)
    return slots, lengths


# --- reading a checkpoint folder ---------------------------------------------------------------------------
def natural_key(text: str) -> list[Any]:
    """Sort key that orders ``rank_2`` before ``rank_10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def file_problem(path: str) -> str | None:
    """Why ``path`` is not a whole ``torch.save`` file, judged from its zip directory alone (no tensor is
    read): empty, truncated or not a torch file; None when it looks whole."""
    try:
        if os.path.getsize(path) == 0:
            return "it is empty"
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                return "it holds no torch data"
    except zipfile.BadZipFile:
        return "it is truncated or not a torch file"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def corrupt_reason(path: str, exc: BaseException) -> str | None:
    """Why ``torch.load(path)`` failed with ``exc`` when the file itself is damaged (truncated, empty, its
    pickled index unreadable); None when it failed for another reason (a refused global, ...)."""
    text = str(exc)
    if "Unsupported global" in text:
        return None
    whole = file_problem(path)
    if whole is not None:
        return whole
    if (isinstance(exc, (EOFError, OSError, zipfile.BadZipFile, pickle.UnpicklingError))
            or "PytorchStreamReader" in text or "WeightsUnpickler" in text):
        return "its contents are corrupt"
    return None


class PickledObject:
    """One of DeepSpeed's small helper objects in its checkpoint files (the loss scaler, ``fragment_address``),
    read back as plain attributes: its class is mapped here by name, never imported, its code never run."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class PickledStage(int):
    """DeepSpeed's ``ZeroStageEnum`` value, read back as its int."""


DEEPSPEED_GLOBALS: list[tuple[Any, str]] = [
    (PickledObject, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (PickledObject, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (PickledObject, "deepspeed.utils.tensor_fragment.fragment_address"),
    (PickledStage, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def load_file(path: str, index_only: bool = False) -> Any:
    """``torch.load`` on CPU with ``weights_only=True``: tensors, containers and numbers only (and DeepSpeed's
    few helper classes, as :class:`PickledObject`). A damaged file is a ``ValueError`` naming it. ``index_only``: the
    pickled index alone, every tensor on the meta device (:func:`read_saved` reads one; a legacy-format file: whole)."""
    try:
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            where = "meta" if index_only and zipfile.is_zipfile(path) else "cpu"
            return torch.load(path, map_location=where, weights_only=True)
    except Exception as exc:  # an UnpicklingError names the global that was refused
        reason = corrupt_reason(path, exc)
        if reason is not None:
            raise ValueError(f"{path}: cannot read this checkpoint file: {reason}") from None
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise ValueError(f"{path}: refusing to load: the file holds objects that could run code when "
                             f"unpickled ({str(exc).splitlines()[0]})") from None
        raise


def read_saved(path: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (from ``load_file(path, index_only=True)``) read from ``path``: only its own bytes, at its
    storage's record offset (torch's zipfile records are stored uncompressed); a tensor in memory as it is."""
    if tensor.device.type != "meta" or not tensor.numel():
        return tensor if tensor.device.type != "meta" else torch.empty(tensor.shape, dtype=tensor.dtype)
    data = bytearray((1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))) * tensor.element_size())
    with open(path, "rb") as fh:
        fh.seek(tensor.untyped_storage()._checkpoint_offset + tensor.storage_offset() * tensor.element_size())
        if fh.readinto(data) != len(data):
            raise ValueError(f"{path}: cannot read this checkpoint file: it is truncated")
    return torch.frombuffer(data, dtype=tensor.dtype).as_strided(tensor.shape, tensor.stride())


def resolve_tag_dir(checkpoint_dir: str, tag: str | None = None) -> str:
    """``checkpoint_dir/tag`` (the tag read from ``latest`` when not given)."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}; pass the tag explicitly")
        with open(latest) as fh:
            tag = fh.read().strip()
    tag_dir = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(tag_dir):
        replaced = os.path.join(checkpoint_dir, f".{tag}.replaced")
        if os.path.isdir(replaced):  # a save of the same tag was interrupted mid-swap: the old copy is whole
            return replaced
        raise FileNotFoundError(f"Directory '{tag_dir}' doesn't exist")
    return tag_dir


def _files(tag_dir: str, suffix: str) -> list[str]:  # the folder's *suffix files in natural order
    return sorted(glob.glob(os.path.join(tag_dir, f"*{suffix}")), key=natural_key)


def merge_slices(slices: list[torch.Tensor], dim: int, parts: int | list | tuple) -> torch.Tensor:
    """The whole tensor from tensor-parallel ranks' slices along ``dim``: ``parts`` equal parts or per-part widths."""
    moved = [s.movedim(dim, 0) for s in slices]
    if isinstance(parts, int):
        whole = torch.cat([m.reshape(parts, m.shape[0] // parts, *m.shape[1:]) for m in moved], dim=1)
        return whole.reshape(-1, *whole.shape[2:]).movedim(0, dim).contiguous()
    pieces = [m.split([int(part[rank]) for part in parts]) for rank, m in enumerate(moved)]
    return torch.cat([p[i] for i in range(len(parts)) for p in pieces]).movedim(0, dim).contiguous()


def get_checkpoint_files(checkpoint_dir: str, glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in natural order (``rank_2`` before
    ``rank_10``); FileNotFoundError when there are none (DeepSpeed's helper)."""
    found = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=natural_key)
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str) -> list[str]:  # the tag folder's *_optim_states.pt, in rank order
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str) -> list[str]:  # the tag folder's *_model_states.pt, in rank order
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def optimizer_master_tensors(osd: dict[str, Any]) -> list[torch.Tensor]:
    """The fp32 master tensors of one rank's ZeRO optimizer state (stages 0-2: padding removed)."""
    if "fp32_flat_groups" in osd:
        return list(osd["fp32_flat_groups"])
    return list(osd["single_partition_of_fp32_groups"])


def _copy_slots(out: dict[str, torch.Tensor], shapes: dict[str, Any], slots: list[Slot],
                master: torch.Tensor) -> int:
    flat = master.reshape(-1)
    for slot in slots:
        if slot.name not in out:
            out[slot.name] = torch.zeros(math.prod(shapes[slot.name]), dtype=torch.float32)
        out[slot.name][slot.full_offset:slot.full_offset + slot.length].copy_(
            flat[slot.master_offset:slot.master_offset + slot.length])
    return sum(slot.length for slot in slots)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             verbose: bool = False, *,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The full fp32 state dict (on CPU) of the checkpoint ``checkpoint_dir/tag`` (``tag`` from ``latest``
    when None). Buffers come from the model states; tied aliases share their source's tensor. ``lazy_mode``
    (DeepSpeed's) is accepted: the tensors are already whole, and ``.contiguous()`` on each returns it. A
    checkpoint saved over tensor-parallel ranks (AutoTP: ``mp_world_size`` > 1) is rebuilt per rank from its
    ``mp_rank_XX`` files and the ranks' slices are put back together (docs/autotp.md)."""
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    model_files = [f for f in _files(tag_dir, MODEL_SUFFIX) if not _is_expert_file(f)]
    degree = int(load_file(model_files[0], index_only=True).get("mp_world_size", 1) or 1) if model_files else 1
    if degree == 1:
        return _fp32_state_dict(tag_dir, exclude_frozen_parameters, verbose, None)
    ranks = [_fp32_state_dict(tag_dir, exclude_frozen_parameters, verbose, r) for r in range(degree)]
    splits = ((load_file(model_files[0], index_only=True).get("dsrun") or {}).get("tensor_parallel") or {})
    merged = ranks[0]
    merged.update({name: merge_slices([state[name] for state in ranks], int(dim), parts)
                   for name, (dim, parts) in (splits.get("splits") or {}).items() if name in merged})
    return merged


def _fp32_state_dict(tag_dir: str, exclude_frozen_parameters: bool, verbose: bool, mp_rank: int | None
                     ) -> "OrderedDict[str, torch.Tensor]":
    """One tensor-parallel rank's fp32 state dict (``mp_rank`` None: the files of every rank, no AutoTP)."""
    say = print if verbose else (lambda *_: None)
    say(f"Processing zero checkpoint '{tag_dir}'" + ("" if mp_rank is None else f" (tensor-parallel rank {mp_rank})"))

    def rank_files(suffix: str) -> list[str]:
        found = [f for f in _files(tag_dir, suffix) if not _is_expert_file(f)]
        return found if mp_rank is None else [f for f in found if f"mp_rank_{mp_rank:02d}_" in os.path.basename(f)]

    model_files = rank_files(MODEL_SUFFIX)
    if not model_files:
        raise FileNotFoundError(f"no '*_{MODEL_SUFFIX}' files in {tag_dir}")
    first = load_file(model_files[0], index_only=True)  # tensors read as needed: buffers, stage 0's masters
    if "buffer_names" not in first:
        raise ValueError(f"{model_files[0]} is not a model states file (no 'buffer_names')")
    extras = first.get("dsrun") or {}
    group_shapes = [OrderedDict(g) for g in first.get("param_shapes") or []]
    optim_files = rank_files(OPTIM_SUFFIX)
    # MoE (any stage): expert groups follow the shared ones and are partitioned over their own expert-data
    # groups; their fp32 masters come whole from the per-expert files, by global id
    expert_fp32 = _expert_masters(tag_dir)
    if expert_fp32:
        group_shapes = group_shapes[:_shared_group_count(group_shapes)]
    shared = dict(first.get("shared_params") or {})
    if first.get("module") is None:
        raise ValueError(f"{model_files[0]} holds no module (a pipeline checkpoint keeps its weights in "
                         "layer_*-model_states.pt): convert it with ds_to_universal instead")
    # the model's key order; a checkpoint without it (older ones, an empty module copy): the module's keys,
    # else the masters' order then the buffers
    order = (extras.get("state_dict_keys") or list(first["module"].keys())
             or [n for g in group_shapes for n in g] + list(first["buffer_names"]))
    # keep only what the fp32 masters do not provide (buffers, frozen parameters), so the 16-bit or fp32
    # module copy is not held next to the output
    trainable = {name for shapes in group_shapes for name in shapes} | set(shared)
    module = {k: read_saved(model_files[0], v) for k, v in first.pop("module").items() if k not in trainable}
    stage0_optimizer = first.pop("optimizer", None)

    out: dict[str, torch.Tensor] = {}
    if optim_files:
        head = load_file(optim_files[0], index_only=True)["optimizer_state_dict"]
        if "zero_stage" not in head:
            raise ValueError(f"{optim_files[0]} is not a zero checkpoint (no 'zero_stage')")
        stage = int(head["zero_stage"])
        count = head["partition_count"]
        world = max(count) if isinstance(count, (list, tuple)) else int(count)
        if head.get("mics_shard_size") and len(optim_files) % world == 0:
            optim_files = optim_files[:world]  # MiCS: the first shard group's ranks hold every partition once
        del head
        if world != len(optim_files):
            raise ValueError(f"Expected {world} of '*_{OPTIM_SUFFIX}' under '{tag_dir}' but found "
                             f"{len(optim_files)} files. Possibly due to an overwrite of an old checkpoint, "
                             "or a checkpoint didn't get saved by one or more processes.")
        sources = [(rank, path) for rank, path in enumerate(optim_files)]
    elif isinstance(stage0_optimizer, dict) and "single_partition_of_fp32_groups" in stage0_optimizer:
        stage, world, sources = 0, 1, [(0, None)]  # stage 0: the one full master copy is in the model states
    else:
        stage, world, sources = -1, 1, []  # no optimizer: the module's weights are all there is
    say(f"Detected checkpoint of type zero stage {stage}, world_size: {world}")
    say(f"Parsing checkpoint created by dsrun, DeepSpeed layout {first.get('ds_version', '?')}")

    total = 0
    for rank, path in sources:
        # only this rank's master weights are read, not its Adam moments (the file's index, then their bytes)
        osd = stage0_optimizer if path is None else load_file(path, index_only=True)["optimizer_state_dict"]
        masters = [read_saved(path or model_files[0], m) for m in optimizer_master_tensors(osd)[:len(group_shapes)]]
        paddings = alignment_paddings(osd.get("param_alignment_paddings"))  # DeepSpeed's parameter_alignment
        slots, _ = master_slots(stage, world, rank, group_shapes, paddings)
        all_shapes = {k: v for g in group_shapes for k, v in g.items()}
        for master, group_slots in zip(masters, slots):
            total += _copy_slots(out, all_shapes, group_slots, master)
        del osd, masters  # this rank's file's index and masters, before the next rank's are read
    out.update({n: out[n].view(shape) for shapes in group_shapes for n, shape in shapes.items() if n in out})
    expected = sum(math.prod(s) for g in group_shapes for s in g.values())
    if sources and total != expected:
        raise ValueError(f"consumed {total} numels out of {expected}: the checkpoint's files do not match its "
                         "param_shapes")

    frozen = _frozen_params(first, model_files, stage) if not exclude_frozen_parameters else {}
    buffers = set(first["buffer_names"])
    result: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name in order:
        if name in shared:
            continue  # filled from its source below
        if name in out:
            result[name] = out[name]
        elif name in frozen:
            result[name] = frozen[name]
        elif name in module and (name in buffers or (stage != 3 and not exclude_frozen_parameters)):
            result[name] = module[name].float() if module[name].is_floating_point() else module[name]
    for alias, source in shared.items():
        if source in result:
            result[alias] = result[source]
    if order:  # the model's own key order, aliases included
        result = OrderedDict((k, result[k]) for k in order if k in result and not (expert_fp32 and EXPERT_MARK in k))
    result.update((name, expert_fp32[name]) for name in sorted(expert_fp32, key=natural_key))
    if out and not result:
        raise ValueError(f"{tag_dir}: none of the {len(out)} parameters with fp32 masters is in the checkpoint's "
                         "key order (state_dict_keys / module): the model states file does not match its masters")
    say(f"Reconstructed fp32 state dict with {len(out)} params {total} elements")
    return result


EXPERT_MARK = ".deepspeed_experts."


def _is_expert_file(path: str) -> bool:
    """DeepSpeed's per-expert files: ``layer_{L}_expert_{G}_mp_rank_{M}_{model,optim}_states.pt``."""
    return re.match(r"layer_\d+_expert_\d+_mp_rank_\d+_", os.path.basename(path)) is not None


def has_expert_files(tag_dir: str) -> bool:
    """Whether a checkpoint tag folder holds per-expert files (an MoE model saved through a ZeRO optimizer)."""
    return any(_is_expert_file(f) for f in _files(tag_dir, MODEL_SUFFIX))


def _expert_masters(tag_dir: str) -> dict[str, torch.Tensor]:
    """Every expert's fp32 master weights by global name (dsrun's per-expert optimizer files)."""
    out: dict[str, torch.Tensor] = {}
    for path in _files(tag_dir, OPTIM_SUFFIX):
        if _is_expert_file(path):
            out.update({k: read_saved(path, v).float() for k, v in load_file(path, index_only=True)["fp32"].items()})
    if not out and has_expert_files(tag_dir):  # weights only (no optimizer)
        for path in _files(tag_dir, MODEL_SUFFIX):
            if _is_expert_file(path):
                out.update({k: v.float() for k, v in load_file(path).items()})
    return out


def _shared_group_count(group_shapes: list[Any]) -> int:
    """How many leading parameter groups hold no expert parameters."""
    kinds = [any(EXPERT_MARK in name for name in shapes) for shapes in group_shapes]
    return kinds.index(True) if True in kinds else len(kinds)


def _frozen_params(first: dict[str, Any], model_files: list[str], stage: int) -> dict[str, torch.Tensor]:
    """Parameters without gradients. Stages 0-2 keep them whole in ``module``; stage 3 has one fragment per
    rank's model states file."""
    shapes = first.get("frozen_param_shapes") or {}
    if not shapes or stage != 3:
        return {}
    pieces: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
    for path in model_files:
        fragments = load_file(path, index_only=True).get("frozen_param_fragments") or {}
        for name in shapes:
            pieces[name].append(read_saved(path, fragments[name]).reshape(-1).float())
    return {name: torch.cat(parts)[: math.prod(shapes[name])].view(shapes[name]) for name, parts in pieces.items()}


SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # decimal, as huggingface_hub parses them
WEIGHTS_NAME, SAFE_WEIGHTS_NAME = "pytorch_model.bin", "model.safetensors"
WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json", "model.safetensors.index.json"
FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")  # an output with one of these is one file (old form)


def parse_shard_size(size: int | str) -> int:
    """Bytes of a ``max_shard_size`` (an int, or digits and a unit: ``"5GB"``, ``"500MB"``, ``"1.5KB"``)."""
    if isinstance(size, int):
        return size
    text = str(size).strip()
    unit = text[-2:].upper()
    if unit not in SIZE_UNITS:
        raise ValueError(f"Unit '{unit}' not supported. Supported units are TB, GB, MB, KB. Got '{text}'.")
    try:
        return int(float(text[:-2].strip()) * SIZE_UNITS[unit])
    except ValueError as exc:
        raise ValueError(f"Could not parse the size value from '{text}': {exc}") from None


def _is_size(value: object) -> bool:
    try:
        return parse_shard_size(value) >= 0  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return False


def split_into_shards(state_dict: "OrderedDict[str, torch.Tensor]", weights_name: str,
                      max_shard_size: int | str) -> tuple[dict[str, list[str]], int]:
    """The file of each key, in DeepSpeed's (huggingface_hub's) order and names: keys in order fill a shard
    until the next would pass ``max_shard_size`` (a larger tensor gets a shard of its own), a tied alias goes
    with its source and counts once; one shard is ``weights_name``, ``n`` shards are
    ``pytorch_model-00001-of-0000n.bin`` (``model-...safetensors``). Returns (file -> keys, total bytes)."""
    limit = parse_shard_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    first_of: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, tensor in state_dict.items():
        if id(tensor) in first_of:
            aliases[first_of[id(tensor)]].append(name)
            continue
        first_of[id(tensor)] = name
        aliases[name] = []
        size = tensor.numel() * tensor.element_size()
        total += size
        if size > limit:
            shards.append([name])
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    shards = [shard + [alias for name in shard for alias in aliases[name]] for shard in shards]
    if len(shards) <= 1:
        return {weights_name: shards[0] if shards else []}, total
    stem, dot, ext = weights_name.rpartition(".")
    return {f"{stem}-{i + 1:05d}-of-{len(shards):05d}{dot}{ext}": shard for i, shard in enumerate(shards)}, total


def _save_atomically(state_dict: dict[str, torch.Tensor], path: str, safe_serialization: bool,
                     metadata: dict[str, str] | None = None) -> None:
    """Write ``state_dict`` to ``path`` (``torch.save``, or safetensors with a tied alias left out and named in
    the metadata); the file appears only when complete (written under a temporary name, then renamed)."""
    tmp = f"{path}.tmp{os.getpid()}"
    if safe_serialization:
        from safetensors.torch import save_file

        sources: dict[int, str] = {}  # each tensor's first name; a later one is an alias of it
        for name, tensor in state_dict.items():
            sources.setdefault(id(tensor), name)
        aliases = {name: sources[id(t)] for name, t in state_dict.items() if sources[id(t)] != name}
        tensors = {name: t.contiguous() for name, t in state_dict.items() if name not in aliases}
        save_file(tensors, tmp, metadata={**(metadata or {}), SHARED_PARAMS_METADATA: json.dumps(aliases)})
    else:
        torch.save(state_dict, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str | None = None,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False, *,
                                               output_file: str | None = None, verbose: bool = True) -> str:
    """Write the consolidated fp32 state dict; returns the folder (or file) written. DeepSpeed's signature and
    outputs: into the folder ``output_dir``, ``pytorch_model.bin`` (``model.safetensors`` with
    ``safe_serialization``), or past ``max_shard_size`` (``"5GB"``; None: never) shards
    ``pytorch_model-00001-of-00002.bin`` ... and the index ``pytorch_model.bin.index.json``
    (``model.safetensors.index.json``: ``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``).

    The older form, one file, stays: ``output_file=PATH``, or an ``output_dir`` ending in ``.bin``, ``.pt``,
    ``.pth`` or ``.safetensors`` that is not a folder; there a third positional argument that is not a size is
    the ``tag`` (the old signature was ``(checkpoint_dir, output_file, tag=None, ...)``). Each file appears
    only when complete (written under a temporary name, then renamed)."""
    if (output_dir is None) == (output_file is None):
        raise TypeError("pass one of output_dir (a folder, DeepSpeed's form) or output_file (one file)")
    one_file = output_file is not None or (str(output_dir).endswith(FILE_SUFFIXES) and not os.path.isdir(output_dir))
    if one_file and tag is None and isinstance(max_shard_size, str) and not _is_size(max_shard_size):
        tag, max_shard_size = max_shard_size, None  # the old third positional argument
    elif max_shard_size is not None:
        parse_shard_size(max_shard_size)  # a bad size fails before the checkpoint is read
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters, verbose)
    if one_file:
        target = str(output_file if output_file is not None else output_dir)
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        if verbose:
            print(f"Saving fp32 state dict to {target}")
        _save_atomically(state_dict, target, safe_serialization)
        return target
    folder = str(output_dir)
    os.makedirs(folder, exist_ok=True)
    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    files, total = (({weights_name: list(state_dict)}, 0) if max_shard_size is None
                    else split_into_shards(state_dict, weights_name, max_shard_size))
    for name, keys in files.items():
        if verbose:
            print(f"Saving fp32 state dict to {os.path.join(folder, name)}")
        shard = OrderedDict((key, state_dict[key]) for key in keys)
        _save_atomically(shard, os.path.join(folder, name), safe_serialization,
                         metadata={"format": "pt"} if safe_serialization else None)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: name for name, keys in files.items() for k in keys}}
        index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
        with open(os.path.join(folder, index_name), "w", encoding="utf-8") as fh:
            fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move ``model`` to CPU and load the checkpoint's fp32 weights into it (``strict=False``, as DeepSpeed
    does); returns the model. A model wrapped by an engine must be re-initialized afterwards."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help="the folder to write pytorch_model.bin (or model.safetensors) into, "
                        "sharded past --max_shard_size with an index; a path ending in .bin, .pt, .pth or "
                        ".safetensors is written as that one file")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard before the next one starts, digits "
                        "and a unit (KB, MB, GB, TB; default 5GB)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of torch.save")
    parser.add_argument("-d", "--debug", action="store_true", help="print progress")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization, tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters, verbose=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
