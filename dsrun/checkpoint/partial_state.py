"""Resharded and universal loads that read, on each rank, only the elements that rank will own.

A resharded load used to merge every saved rank's optimizer file into the whole optimizer state in memory
(:func:`.reshard.merge_rank_states`) and then cut the rank's share out of it. The sources here give
:func:`.reshard.state_for_rank` the same values read straight from the files by byte range
(:class:`.tensor_file.TensorFile`), so a rank holds its own share, plus at most one cast buffer:

* :class:`PartialRankState`: the saved ranks' ``*_optim_states.pt`` files (dsrun's or DeepSpeed's). Where each
  parameter's elements sit in each saved rank's flat master and moments is recomputed from the checkpoint's
  ``param_shapes`` (:func:`dsrun.utils.zero_to_fp32.master_slots`, the layout both frameworks write), so no
  metadata beyond what DeepSpeed saves is needed. Every saved file's pickled index is still read (small).
* :class:`PartialStagesState`: a pipeline checkpoint's saved stages, each stage's optimizer files read so (a stage
  saved at ZeRO stage 0: its model states file's optimizer state).
* :class:`PartialDeepSpeedStage0State`: DeepSpeed's own stage-0 layout (per-parameter state, or fp16's flat
  groups), each parameter's range read where DeepSpeed keeps it (:func:`.deepspeed_format.stage0_groups`).
* :func:`saved_state`: the source a resharded load (or ``ds_to_universal``) reads a checkpoint's saved state from.
* :class:`PartialUniversalState`: a universal folder's per-parameter files; each rank reads the range of each
  ``fp32.pt``/``exp_avg.pt``... that falls in its partition.
* :class:`PartialRankStates`: the saved ranks' per-rank optimizer files (1-bit error buffers), each tensor's
  ranges read by the optimizer that re-cuts them (:mod:`dsrun.optim.rank_state`).
* :func:`model_states_without_parameters`: a model states file with the module's parameters left unread, for a
  layout whose parameters come through the masters (ZeRO-3), which reads only the buffers of a full module
  (a universal folder's, or a stage 0-2 save's); and a stage-0 save's optimizer state (kept in that file) left
  unread, for :class:`PartialRankState` (``key=STAGE0_KEY``) to read the rank's ranges of.

The values are the merged path's bit for bit (the same slots, the same casts); ``tests/unit/checkpoint/
test_partial_reads.py`` checks it, and that a rank reads its share.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import torch
from torch import nn

from dsrun.utils import zero_to_fp32 as z2f
from dsrun.utils.zero_to_fp32 import Slot

from . import deepspeed_format, layout, reshard
from .engine_view import CheckpointStrategy
from .tensor_file import TensorFile, has_unread, read_unread, tensors_in
from .universal_checkpoint import FP32, OPTIMIZER_STATE, PARAM, STEP, UNIVERSAL_DIR
from .safe_load import check_records, load_file
from .saved_tag import optim_files, refuse_mics, saved_stage, saved_world


class _Piece:
    """Elements of one parameter held by one saved master tensor: ``slot`` says where (:class:`Slot`)."""

    __slots__ = ("file", "master", "per_element", "slot")

    def __init__(self, file: TensorFile, master: torch.Tensor, per_element: dict[str, torch.Tensor], slot: Any) -> None:
        self.file, self.master, self.per_element, self.slot = file, master, per_element, slot

    def copy_range(self, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        """The part of ``[full_offset, full_offset + out.numel())`` this piece holds, into ``out``."""
        slot = self.slot
        lo = max(full_offset, slot.full_offset)
        hi = min(full_offset + out.numel(), slot.full_offset + slot.length)
        source = self.master if key is None else self.per_element.get(key)
        if hi > lo and source is not None:
            self.file.read(source, slot.master_offset + lo - slot.full_offset, out[lo - full_offset:hi - full_offset])


def _open_rank_file(path: Path, stage: int, world: int, rank: int, group_shapes: list[dict[str, Any]],
                    key: str) -> tuple[TensorFile, dict[str, Any]]:
    """A saved rank's optimizer file opened for partial reads, and its ZeRO state (the file's entry ``key``) as
    dsrun's strategies read it (:func:`.deepspeed_format.to_dsrun`; a stage-0 model states file's ``optimizer``
    is dsrun's already) with every tensor of it read but the masters and per-element states (and their views)."""
    file = TensorFile(path)
    raw = file.objects[key]
    ours = (lambda: deepspeed_format.to_dsrun(raw)) if key == OPTIMIZER_FILE_KEY else (lambda: raw)
    if file.partial:  # the bulk found in dsrun's form (the same tensor objects), then read in place into raw
        file.materialise_all(raw, _with_views(raw, reshard.bulk_tensors(ours(), stage, world, rank, group_shapes)))
    return file, ours()


def _record(tensor: torch.Tensor) -> int | None:
    return getattr(tensor.untyped_storage(), "_checkpoint_offset", None)


def _with_views(obj: object, bulk: list[torch.Tensor]) -> set[int]:
    """The ids of the tensors in ``obj`` stored in the same records as ``bulk`` (the tensors themselves and their
    views: a stage-0 save's per-parameter DeepSpeed keys view its flat masters and moments)."""
    records = {_record(t) for t in bulk} - {None}
    return {id(t) for t in tensors_in(obj) if _record(t) in records} | {id(t) for t in bulk}


OPTIMIZER_FILE_KEY = "optimizer_state_dict"  # the ZeRO state's entry in a ``*_optim_states.pt`` file
STAGE0_KEY = "optimizer"  # a stage-0 save's: in its model states file


class _Closes:
    """``with`` closes the reader's open files (``close()``) however the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PartialRankState(_Closes):
    """The saved ranks' optimizer files (in rank order) as a :class:`.reshard.StateSource`; ``key``: where the
    ZeRO state is in each (:data:`STAGE0_KEY`: a stage-0 save's model states file). Use as a context manager
    (the files are closed at its end)."""

    def __init__(self, paths: list[Path], stage: int, group_shapes: list[dict[str, Any]],
                 key: str = OPTIMIZER_FILE_KEY) -> None:
        self.files: list[TensorFile] = []
        self.pieces: dict[str, list[_Piece]] = {}
        self.group_scalars: dict[int, dict[str, Any]] = {}
        self.param_groups: list[dict[str, Any]] = []
        self.precision: dict[str, Any] = {}
        self.param_group_of: dict[str, int] = {}  # name -> the param group it trains in
        world = len(paths)
        try:
            for rank, path in enumerate(paths):
                file, osd = _open_rank_file(path, stage, world, rank, group_shapes, key)
                self.files.append(file)
                if rank == 0:
                    refuse_mics(path.parent, osd)
                    self.param_groups, self.precision = reshard.saved_header(osd)
                for saved in reshard.saved_masters(osd, stage, world, rank, group_shapes):
                    if rank == 0 and saved.group not in self.group_scalars:
                        self.group_scalars[saved.group] = saved.scalars
                    for slot in saved.slots:
                        self.param_group_of[slot.name] = saved.group
                        self.pieces.setdefault(slot.name, []).append(_Piece(file, saved.master, saved.per_element, slot))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for file in self.files:
            file.close()

    def has_master(self, name: str) -> bool:
        return name in self.pieces

    def moment_keys(self, name: str) -> set[str]:
        return {key for piece in self.pieces.get(name, []) for key in piece.per_element}

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return next(p.per_element[key].dtype for p in self.pieces[name] if key in p.per_element)

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        for piece in self.pieces[name]:
            piece.copy_range(key, full_offset, out)


class PartialStagesState(_Closes):
    """Every saved stage of a pipeline checkpoint as one :class:`.reshard.StateSource`, by pipeline parameter
    name, as :func:`.pipeline_state.merge_stages` merges them (a name saved by two stages, a tied module's, from
    the later; each group's scalars from the first): a stage saved at ZeRO 1-3 read by range from its optimizer
    files, one saved at stage 0 from its model states file (``slices`` as :func:`.pipeline_state.saved_slices`
    opened them, the optimizer state left unread; :class:`PartialRankState` either way). Use as a context
    manager."""

    def __init__(self, tag_dir: Path, slices: list[dict[str, Any]], bf16: bool) -> None:
        self.group_scalars: dict[int, dict[str, Any]] = {}
        self.param_groups: list[dict[str, Any]] = []
        self.precision: dict[str, Any] = {}
        self.param_group_of: dict[str, int] = {}
        self._of: dict[str, reshard.StateSource] = {}
        self._open: list[PartialRankState] = []
        try:
            for slice_rank, sd in enumerate(slices):
                shapes, stage = sd.get("param_shapes"), int(sd["dsrun"]["zero_stage"])
                if shapes is None:
                    continue
                part: Any
                if stage == 0 and not left_unread(sd):  # read whole already (a legacy-format file)
                    part = reshard.merge_rank_states([sd[STAGE0_KEY]], 0, shapes)
                else:
                    paths, key = (([tag_dir / layout.model_states_name(0, 0, mp_rank=slice_rank)], STAGE0_KEY)
                                  if stage == 0 else (optim_files(tag_dir, int(sd.get("dp_world_size", 1)), bf16,
                                                                  mp_rank=slice_rank), OPTIMIZER_FILE_KEY))
                    part = PartialRankState(paths, stage, shapes, key)
                    self._open.append(part)
                self._of.update({name: part for group in shapes for name in group})
                self.param_group_of.update(part.param_group_of)
                for gi, scalars in part.group_scalars.items():
                    self.group_scalars.setdefault(gi, scalars)
                self.param_groups = self.param_groups or part.param_groups
                self.precision = self.precision or part.precision
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for part in self._open:
            part.close()

    def has_master(self, name: str) -> bool:
        return name in self._of and self._of[name].has_master(name)

    def moment_keys(self, name: str) -> set[str]:
        return self._of[name].moment_keys(name) if name in self._of else set()

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self._of[name].moment_dtype(name, key)

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        self._of[name].copy_range(name, key, full_offset, out)


class PartialDeepSpeedStage0State(_Closes):
    """DeepSpeed's own stage-0 layout (its optimizer state in the model states file ``path``, per parameter or in
    a fused wrapper's flat groups: :func:`.deepspeed_format.stage0_groups`) as a :class:`.reshard.StateSource`
    that reads the asked ranges of each parameter's master and moments (fp32: the master is the module's
    weight in the same file). ``group_shapes``: the live strategy's (DeepSpeed's stage-0 file names none), the
    values those of :func:`.deepspeed_format.stage0_to_dsrun` bit for bit. Use as a context manager."""

    def __init__(self, path: Path, group_shapes: list[dict[str, Any]]) -> None:
        self.file = TensorFile(path)
        try:
            objects = self.file.objects
            sd = objects[STAGE0_KEY]
            groups = deepspeed_format.stage0_groups(sd, group_shapes, objects.get("module") or {})
            self.param_groups = [self.file.materialise_all(g.hyper, set()) for g in groups]
            self.group_scalars = {gi: self.file.materialise_all(g.scalars, set()) for gi, g in enumerate(groups)}
            self.precision = deepspeed_format.stage0_scale(sd)
            self.param_group_of = {p.name: gi for gi, g in enumerate(groups) for p in g.parameters}
            self.pieces = {p.name: _Piece(self.file, p.master.reshape(-1),
                                          {k: v.reshape(-1) for k, v in p.moments.items()},
                                          Slot(p.name, p.offset, 0, p.numel)) for g in groups for p in g.parameters}
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.file.close()

    def has_master(self, name: str) -> bool:
        return name in self.pieces

    def moment_keys(self, name: str) -> set[str]:
        return set(self.pieces[name].per_element) if name in self.pieces else set()

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self.pieces[name].per_element[key].dtype

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        self.pieces[name].copy_range(key, full_offset, out)


def saved_state(tag_dir: Path, model_path: Path, stage: int, world: int, group_shapes: list[dict[str, Any]],
                deepspeed_stage0: bool, bf16: bool, mp_rank: int = 0
                ) -> PartialRankState | PartialDeepSpeedStage0State:
    """A checkpoint's saved optimizer state, read by range: every saved rank's optimizer file (of tensor-parallel
    rank ``mp_rank``), or a stage-0 save's model states file ``model_path`` (dsrun's flat layout, or DeepSpeed's
    own, ``deepspeed_stage0``)."""
    if deepspeed_stage0:
        return PartialDeepSpeedStage0State(model_path, group_shapes)
    if stage == 0:
        return PartialRankState([model_path], 0, group_shapes, STAGE0_KEY)
    return PartialRankState(optim_files(tag_dir, world, bf16, mp_rank=mp_rank), stage, group_shapes)


@contextmanager
def saved_fp32(tag_dir: Path, model_path: Path, model_states: dict[str, Any], bf16: bool, mp_rank: int = 0
               ) -> Iterator[reshard.StateSource]:
    """The checkpoint's fp32 master weights for a weights-only load (``load_module_only``,
    ``load_optimizer_states=False``) as a :class:`.reshard.StateSource`: read by range from the saved ranks'
    optimizer files (or a stage-0 save's model states file, its optimizer state left unread there), so a rank
    reads only the ranges it asks for (:class:`PartialRankState`); the values are ``zero_to_fp32``'s bit for bit
    (the same masters, the same slots). A checkpoint whose masters are not in ZeRO's flat layout (no optimizer
    saved, DeepSpeed's own stage-0 layout, a legacy stage-0 file read whole) is consolidated by
    ``zero_to_fp32``, as before."""
    shapes, stage = model_states.get("param_shapes"), saved_stage(model_states, tag_dir)
    if shapes is None or deepspeed_format.is_deepspeed_stage0(model_states.get(STAGE0_KEY)) \
            or not (stage > 0 or left_unread(model_states)):
        yield reshard.fp32_as_full_state(z2f.get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent),
                                                                                     tag_dir.name))
        return
    with saved_state(tag_dir, model_path, stage, saved_world(model_states), shapes, False, bf16, mp_rank) as source:
        yield source


def read_fp32_into(module: nn.Module, names: list[str], source: reshard.StateSource) -> None:
    """Each parameter ``names`` of ``module`` (a stage-3 save's placeholders, loaded into a module with no
    optimizer to carry its masters) read from ``source`` (:func:`saved_fp32`), one parameter at a time: straight
    into the live tensor where it is a contiguous fp32 CPU tensor, else through one fp32 buffer of its size, cast
    as ``load_state_dict`` casts. A name the checkpoint has no master for is left as it is."""
    live = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in names:
            target = live.get(name)
            if target is None or not source.has_master(name):
                continue
            direct = target.dtype == torch.float32 and target.device.type == "cpu" and target.is_contiguous()
            buffer = target.detach().view(-1) if direct else torch.empty(target.numel(), dtype=torch.float32)
            source.copy_range(name, None, 0, buffer)
            if not direct:
                target.copy_(buffer.view(target.shape))


def _value(entry: Any) -> torch.Tensor:
    return (entry[PARAM] if isinstance(entry, dict) else entry).reshape(-1)


class PartialUniversalState(_Closes):
    """A universal folder (:mod:`.universal_checkpoint`) as a :class:`.reshard.StateSource`: each parameter's
    files are opened (their index read) when first asked for, and only the asked ranges are read."""

    def __init__(self, tag_dir: Path) -> None:
        self.root = Path(tag_dir) / UNIVERSAL_DIR
        meta = load_file(self.root / OPTIMIZER_STATE)
        self.param_groups = list(meta.get("param_groups", []))
        self.precision = dict(meta.get("precision", {}))
        self.group_scalars = {int(k): dict(v) for k, v in (meta.get("group_scalars") or {}).items()}
        self._states: dict[str, list[str]] = {}  # parameter -> its optimizer states' names (files)
        self._open: dict[tuple[str, str], tuple[TensorFile, torch.Tensor]] = {}
        steps: dict[str, Any] = {}
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if not (folder / f"{FP32}.pt").is_file():
                continue
            states = [p.stem for p in sorted(folder.glob("*.pt")) if p.stem not in (FP32, STEP)]
            self._states[folder.name] = states
            if (folder / f"{STEP}.pt").is_file():
                steps[folder.name] = load_file(folder / f"{STEP}.pt")
        if not self._states:
            raise FileNotFoundError(f"{self.root}: no '<parameter>/{FP32}.pt' files: not a universal checkpoint")
        groups_of = meta.get("param_group_of") or {}
        for name, step in steps.items():  # a folder written by DeepSpeed has no group scalars: take each group's step
            self.group_scalars.setdefault(int(groups_of.get(name, 0)), {}).setdefault(STEP, step)

    def _tensor(self, name: str, state: str) -> tuple[TensorFile, torch.Tensor]:
        if (name, state) not in self._open:
            file = TensorFile(self.root / name / f"{state}.pt")
            self._open[(name, state)] = (file, _value(file.objects))
        return self._open[(name, state)]

    def close(self) -> None:
        for file, _ in self._open.values():
            file.close()

    def has_master(self, name: str) -> bool:
        return name in self._states

    def moment_keys(self, name: str) -> set[str]:
        return set(self._states.get(name, []))

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self._tensor(name, key)[1].dtype

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        file, tensor = self._tensor(name, FP32 if key is None else key)
        file.read(tensor, full_offset, out)


class PartialRankStates(_Closes):
    """Every saved rank's per-rank optimizer file (``optimizer_rank_states_<r>.pt``: the 1-bit error buffers,
    0/1 Adam's local weights, Muon's momentum) for a load at another layout: ``states`` holds what each file
    holds with every tensor of more than one element left unread, and :meth:`read` (a
    :data:`dsrun.optim.rank_state.RangeRead`) reads any element range of one of them, so the optimizer's re-cut
    reads only the elements it keeps. Use as a context manager."""

    def __init__(self, paths: list[Path]) -> None:
        self.files: list[TensorFile] = []
        self._file_of: dict[int, TensorFile] = {}  # id of an unread tensor -> its file
        try:
            for path in paths:
                file = TensorFile(path)
                self.files.append(file)
                bulk = {id(t) for t in tensors_in(file.objects) if t.numel() > 1} if file.partial else set()
                file.materialise_all(file.objects, bulk)
                self._file_of.update({id(t): file for t in tensors_in(file.objects) if id(t) in bulk})
        except BaseException:
            self.close()
            raise
        self.states: list[dict[str, Any]] = [file.objects for file in self.files]

    def close(self) -> None:
        for file in self.files:
            file.close()

    def read(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        file = self._file_of.get(id(tensor))
        if file is None:  # read at opening (a scalar) or already in memory
            out.copy_(tensor.reshape(-1)[start:start + out.numel()])
        else:
            file.read(tensor, start, out)


def restore_rank_states(strategy: CheckpointStrategy, tag_dir: Path, saved_world: int, dp_rank: int,
                        same_layout: bool) -> None:
    """The per-rank optimizer state (``optimizer_rank_states_<r>.pt``): this rank's own file when the layout is
    the same, every saved rank's otherwise (:class:`PartialRankStates`: the optimizer re-cuts them, reading the
    ranges it keeps); none saved: an empty list."""
    files = [tag_dir / layout.rank_states_name(r) for r in range(saved_world)]
    if not all(f.is_file() for f in files):
        strategy.load_rank_state_dicts([])
    elif same_layout:
        strategy.load_rank_state_dicts([load_file(files[dp_rank])])
    else:
        with PartialRankStates(files) as saved:
            strategy.load_rank_state_dicts(saved.states, saved.read)


def model_states_without_parameters(path: Path, parameter_names: set[str], module_unread: bool = False
                                    ) -> dict[str, Any]:
    """The model states file ``path`` with every tensor read but the module's entries named in
    ``parameter_names`` (all of them with ``module_unread``), which stay on the meta device (never read here;
    :func:`read_module_into` reads them into the live module), and, in a stage-0 save (whose optimizer state is
    in this file), the optimizer's masters and per-element states: a resharded load reads them by range
    (:class:`PartialRankState` with :data:`STAGE0_KEY`), a load at the saved layout whole
    (:func:`read_stage0_state`). Any other file with no names to leave is read whole (:func:`.safe_load.load_file`)."""
    with TensorFile(path) as file:
        objects = file.objects
        module = objects.get("module") or {}
        keep = {id(v) for k, v in module.items() if (module_unread or k in parameter_names) and torch.is_tensor(v)}
        keep |= _stage0_bulk(objects) if file.partial else set()
        if not keep:
            return load_file(path) if file.partial else objects  # tensors sharing storage stay shared
        return file.materialise_all(objects, keep)


def reads_into(module: nn.Module) -> bool:
    """Whether :func:`read_module_into` can read a saved module straight into ``module``: no submodule changes
    what ``load_state_dict`` does with its entries (a pre-hook or its own ``_load_from_state_dict``)."""
    return all(not m._load_state_dict_pre_hooks and type(m)._load_from_state_dict is nn.Module._load_from_state_dict
               for m in module.modules())


def read_module_into(module: nn.Module, module_sd: dict[str, Any], path: Path) -> dict[str, Any]:
    """``module_sd`` (the module of the model states file ``path``, its tensors left unread by
    :func:`model_states_without_parameters`; MoE's experts left unread in their own files) for
    ``module.load_state_dict``: each entry whose live tensor has its shape is read straight into that tensor
    (:meth:`.TensorFile.read_into`: a cast or another device through one tensor-sized buffer) and becomes the
    live tensor itself, so ``load_state_dict``'s copy is a no-op and its checks run as before; any other entry
    is read whole. The load holds no second copy of the module. Each file's CRC32s are checked first, as a whole
    load checks them (read through the page cache, bounded)."""
    live = module.state_dict(keep_vars=True)
    out, done, files = dict(module_sd), set(), {}
    try:
        for name, saved in module_sd.items():
            if not torch.is_tensor(saved) or saved.device.type != "meta":
                continue
            where = Path(getattr(saved.untyped_storage(), "_checkpoint_path", path))
            if where not in files:
                check_records(where)
                files[where] = TensorFile(where, index=False)
            file, target = files[where], live.get(name)
            if target is None or target.shape != saved.shape:
                out[name] = file.materialise(saved)  # load_state_dict says what is wrong with it
                continue
            key = (target.data_ptr(), where, _record(saved), saved.storage_offset(), saved.stride())
            if key not in done:  # a tied weight saved under two names: read once
                done.add(key)
                file.read_into(saved, target)
            out[name] = target
    finally:
        for file in files.values():
            file.close()
    return out


def _stage0_bulk(objects: dict[str, Any]) -> set[int]:
    """The ids of a stage-0 save's optimizer masters and per-element states (with their views; in DeepSpeed's own
    layout every tensor of more than one element), none for another stage's file."""
    osd, shapes = objects.get(STAGE0_KEY), objects.get("param_shapes")
    if deepspeed_format.is_deepspeed_stage0(osd):
        return {id(t) for t in tensors_in(osd) if t.dim() > 0}
    if not isinstance(osd, dict) or osd.get("zero_stage") != 0 or not shapes:
        return set()
    return _with_views(osd, reshard.bulk_tensors(osd, 0, 1, 0, shapes))


def left_unread(model_states: dict[str, Any]) -> bool:
    """Whether :func:`model_states_without_parameters` left a stage-0 save's optimizer state unread."""
    return has_unread(model_states.get(STAGE0_KEY))


def read_stage0_state(path: Path, model_states: dict[str, Any]) -> None:
    """Read what :func:`model_states_without_parameters` left unread of the stage-0 optimizer state in
    ``model_states`` (from the file ``path``), in place; and the module's, in DeepSpeed's own stage-0 layout
    (whose fp32 masters are the module's weights)."""
    if STAGE0_KEY in model_states:
        model_states[STAGE0_KEY] = read_unread(path, model_states[STAGE0_KEY])
        if deepspeed_format.is_deepspeed_stage0(model_states[STAGE0_KEY]) and model_states.get("module"):
            model_states["module"] = read_unread(path, model_states["module"])
