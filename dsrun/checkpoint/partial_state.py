"""Resharded and universal loads that read, on each rank, only the elements that rank will own.

A resharded load used to merge every saved rank's optimizer file into the whole optimizer state in memory
(:func:`.reshard.merge_rank_states`) and then cut the rank's share out of it. The sources here give
:func:`.reshard.state_for_rank` the same values read straight from the files by byte range
(:class:`.tensor_file.TensorFile`), so a rank holds its own share, plus at most one cast buffer:

* :class:`PartialRankState`: the saved ranks' ``*_optim_states.pt`` files (dsrun's or DeepSpeed's). Where each
  parameter's elements sit in each saved rank's flat master and moments is recomputed from the checkpoint's
  ``param_shapes`` (:func:`dsrun.utils.zero_to_fp32.master_slots`, the layout both frameworks write), so no
  metadata beyond what DeepSpeed saves is needed. Every saved file's pickled index is still read (small).
* :class:`PartialUniversalState`: a universal folder's per-parameter files; each rank reads the range of each
  ``fp32.pt``/``exp_avg.pt``... that falls in its partition.
* :func:`model_states_without_parameters`: a model states file with the module's parameters left unread, for a
  layout whose parameters come through the masters (ZeRO-3), which reads only the buffers of a full module
  (a universal folder's, or a stage 0-2 save's).

The values are the merged path's bit for bit (the same slots, the same casts); ``tests/unit/checkpoint/
test_partial_reads.py`` checks it, and that a rank reads its share.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import deepspeed_format, reshard
from .tensor_file import TensorFile
from .universal_checkpoint import FP32, OPTIMIZER_STATE, PARAM, STEP, UNIVERSAL_DIR
from .safe_load import load_file
from .saved_tag import refuse_mics


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


def _open_rank_file(path: Path, stage: int, world: int, rank: int,
                    group_shapes: list[dict[str, Any]]) -> tuple[TensorFile, dict[str, Any]]:
    """A saved rank's optimizer file opened for partial reads, and its ZeRO state as dsrun's strategies read it
    (:func:`.deepspeed_format.to_dsrun`) with every tensor read but the masters and per-element states."""
    file = TensorFile(path)
    raw = file.objects["optimizer_state_dict"]
    if file.partial:
        file.materialise_all(file.objects, {id(t) for t in reshard.bulk_tensors(raw, stage, world, rank, group_shapes)})
    return file, deepspeed_format.to_dsrun(file.objects["optimizer_state_dict"])


class PartialRankState:
    """The saved ranks' optimizer files (in rank order) as a :class:`.reshard.StateSource`. Use as a context
    manager (the files are closed at its end)."""

    def __init__(self, paths: list[Path], stage: int, group_shapes: list[dict[str, Any]]) -> None:
        self.files: list[TensorFile] = []
        self.pieces: dict[str, list[_Piece]] = {}
        self.group_scalars: dict[int, dict[str, Any]] = {}
        self.param_groups: list[dict[str, Any]] = []
        self.precision: dict[str, Any] = {}
        world = len(paths)
        try:
            for rank, path in enumerate(paths):
                file, osd = _open_rank_file(path, stage, world, rank, group_shapes)
                self.files.append(file)
                if rank == 0:
                    refuse_mics(path.parent, osd)
                    self.param_groups, self.precision = reshard.saved_header(osd)
                for saved in reshard.saved_masters(osd, stage, world, rank, group_shapes):
                    if rank == 0 and saved.group not in self.group_scalars:
                        self.group_scalars[saved.group] = saved.scalars
                    for slot in saved.slots:
                        self.pieces.setdefault(slot.name, []).append(_Piece(file, saved.master, saved.per_element, slot))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for file in self.files:
            file.close()

    def __enter__(self) -> "PartialRankState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has_master(self, name: str) -> bool:
        return name in self.pieces

    def moment_keys(self, name: str) -> set[str]:
        return {key for piece in self.pieces.get(name, []) for key in piece.per_element}

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return next(p.per_element[key].dtype for p in self.pieces[name] if key in p.per_element)

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        for piece in self.pieces[name]:
            piece.copy_range(key, full_offset, out)


def _value(entry: Any) -> torch.Tensor:
    return (entry[PARAM] if isinstance(entry, dict) else entry).reshape(-1)


class PartialUniversalState:
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

    def __enter__(self) -> "PartialUniversalState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has_master(self, name: str) -> bool:
        return name in self._states

    def moment_keys(self, name: str) -> set[str]:
        return set(self._states.get(name, []))

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self._tensor(name, key)[1].dtype

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        file, tensor = self._tensor(name, FP32 if key is None else key)
        file.read(tensor, full_offset, out)


def model_states_without_parameters(path: Path, parameter_names: set[str]) -> dict[str, Any]:
    """The model states file ``path`` with every tensor read but the module's entries named in
    ``parameter_names``, which stay on the meta device (never read)."""
    with TensorFile(path) as file:
        module = file.objects.get("module") or {}
        keep = {id(v) for k, v in module.items() if k in parameter_names and torch.is_tensor(v)}
        return file.materialise_all(file.objects, keep)
