"""Loading ZeRO optimizer state saved by N ranks (any stage) into an engine with M ranks (any stage).

The state is seen per parameter, free of world size and stage: each parameter's fp32 master value and each of
its optimizer moments (``exp_avg``…) as flat full-length values, plus the per-group scalars (``step``) and
hyper-parameters (a :class:`StateSource`). :func:`state_for_rank` cuts it the way the live strategy lays out
its own rank's master tensors (:func:`dsrun.utils.zero_to_fp32.master_slots` describes both layouts), reading
only that rank's elements, and returns it in the strategy's own format, as if it had been saved by this run.

Two kinds of source: :class:`FullOptimizerState`, every value in memory (:func:`merge_rank_states` merges the
saved ranks' state dicts into one: the conversion to a universal folder, pipelines, experts), and the partial
readers of :mod:`.partial_state`, which read each asked range from the saved files (the engine's resharded and
universal loads).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from dsrun.utils.zero_to_fp32 import BASE_OPTIMIZER_KEYS, alignment_paddings, master_slots, optimizer_master_tensors

log = logging.getLogger("dsrun.checkpoint")

_PRECISION_KEYS = ("loss_scaler", "dynamic_loss_scale")


class StateSource(Protocol):
    """Where :func:`state_for_rank` reads the per-parameter state from: a merged :class:`FullOptimizerState`
    (every value in memory), or the saved files themselves read by byte range (:mod:`.partial_state`)."""

    group_scalars: dict[int, dict[str, Any]]  # param group -> {"step": ...}
    param_groups: list[dict[str, Any]]  # hyper-parameters, without "params"
    precision: dict[str, Any]

    def has_master(self, name: str) -> bool: ...

    def moment_keys(self, name: str) -> set[str]: ...

    def moment_dtype(self, name: str, key: str) -> torch.dtype: ...

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        """Elements ``[full_offset, full_offset + out.numel())`` of parameter ``name``'s flattened fp32 master
        (``key`` None) or optimizer state ``key`` into ``out``."""


@dataclass
class FullOptimizerState:
    """Optimizer state independent of world size and stage."""

    fp32: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> flat fp32 master value
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> key -> flat value
    group_scalars: dict[int, dict[str, Any]] = field(default_factory=dict)  # param group -> {"step": ...}
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # hyper-parameters, without "params"
    precision: dict[str, Any] = field(default_factory=dict)
    param_group_of: dict[str, int] = field(default_factory=dict)  # name -> the param group it trains in

    def has_master(self, name: str) -> bool:
        return name in self.fp32

    def moment_keys(self, name: str) -> set[str]:
        return set(self.moments.get(name, {}))

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self.moments[name][key].dtype

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        value = self.fp32[name] if key is None else self.moments[name][key]
        out.copy_(value[full_offset:full_offset + out.numel()])


class RenamedSource:
    """``source`` (a :class:`StateSource`) asked by other names: ``name_of(name)`` is its name of ``name`` (a
    pipeline's parameters in a universal folder, by layer name)."""

    def __init__(self, source: StateSource, name_of: Callable[[str], str]) -> None:
        self.source, self.name_of = source, name_of
        self.group_scalars, self.param_groups, self.precision = (source.group_scalars, source.param_groups,
                                                                 source.precision)

    def has_master(self, name: str) -> bool:
        return self.source.has_master(self.name_of(name))

    def moment_keys(self, name: str) -> set[str]:
        return self.source.moment_keys(self.name_of(name))

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self.source.moment_dtype(self.name_of(name), key)

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        self.source.copy_range(self.name_of(name), key, full_offset, out)


def _base_state(osd: dict[str, Any]) -> dict[str, Any]:
    for key in BASE_OPTIMIZER_KEYS:
        if key in osd:
            return osd[key]
    raise KeyError("no base optimizer state in a ZeRO optimizer state dict")


def _master_to_group(base: dict[str, Any]) -> dict[int, int]:
    owner = {}
    for gi, group in enumerate(base["param_groups"]):
        for index in group["params"]:
            owner[int(index)] = gi
    return owner


@dataclass
class SavedMaster:
    """One master tensor of one saved rank: its param group, the flat fp32 master, its per-element optimizer
    states (flat, the master's length), the rest of its optimizer state (``step``...) and where its
    parameters' elements sit (:func:`master_slots`)."""

    group: int
    master: torch.Tensor
    per_element: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    slots: list[Any]


def saved_masters(osd: dict[str, Any], stage: int, world: int, rank: int,
                  group_shapes: list[dict[str, Any]]) -> list[SavedMaster]:
    """Rank ``rank``'s master tensors in its optimizer state dict ``osd`` (saved by ``world`` ranks at ``stage``)."""
    slots, lengths = master_slots(stage, world, rank, group_shapes, _paddings(osd))
    base = _base_state(osd)
    owner = _master_to_group(base)
    out = []
    for mi, (master, master_slots_) in enumerate(zip(optimizer_master_tensors(osd), slots)):
        state = base["state"].get(mi, base["state"].get(str(mi), {}))
        per_element = _per_element(state, lengths[mi], master.numel())
        scalars = {k: v for k, v in state.items() if k not in per_element}
        out.append(SavedMaster(owner.get(mi, 0), master.reshape(-1), {k: v.reshape(-1) for k, v in per_element.items()},
                               scalars, master_slots_))
    return out


def _paddings(osd: dict[str, Any]) -> list[list[int]] | None:
    """The gaps ``zero_optimization.parameter_alignment`` left between the parameters of ``osd``'s masters."""
    return alignment_paddings(osd.get("param_alignment_paddings"))


def loads_as_saved(osd: dict[str, Any], live: list[list[int]] | None) -> bool:
    """Whether the strategy loads ``osd`` (a saved rank's ZeRO state at the live stage and world size) as it is:
    it has the live strategy's ``parameter_alignment`` gaps ``live`` (then its partitions are the live ones) and
    DeepSpeed's rigid layout. Else a load re-cuts it (:func:`state_for_rank`): saved with other gaps (the
    strategy's ``load_state_dict`` refuses it), or elastic (``zero_optimization.elastic_checkpoint``: the last
    rank's states lack the padding and the param groups their hyper-parameters)."""
    return _paddings(osd) == alignment_paddings(live) and not osd.get("elastic")


def _per_element(state: dict[str, Any], length: int, unpadded: int) -> dict[str, torch.Tensor]:
    """The optimizer states that hold one value per master element (Adam's moments), as saved: ``length`` (the
    padded master's) or ``unpadded`` values (the master's without its padding: DeepSpeed's elastic layout)."""
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() in (length, unpadded)}


def bulk_tensors(osd: dict[str, Any], stage: int, world: int, rank: int,
                 group_shapes: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The tensors of saved rank ``rank``'s ``osd`` that grow with the model: its masters and per-element
    optimizer states (the objects in ``osd``; a partial read reads only ranges of them)."""
    _, lengths = master_slots(stage, world, rank, group_shapes, _paddings(osd))
    base = _base_state(osd)
    masters = list(optimizer_master_tensors(osd))
    out = list(masters)
    for mi, master in enumerate(masters):
        state = base["state"].get(mi, base["state"].get(str(mi), {}))
        if mi < len(lengths):
            out.extend(_per_element(state, lengths[mi], master.numel()).values())
        else:  # a master beyond ``group_shapes`` (MoE's experts, read from their own files): none of it is read
            out.extend(v for v in state.values() if torch.is_tensor(v) and v.dim() > 0 and v.numel() >= master.numel())
    return out


def saved_header(osd: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Saved rank 0's param-group hyper-parameters (without ``params``) and loss-scaler keys."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in _base_state(osd)["param_groups"]]
    return groups, {k: osd[k] for k in _PRECISION_KEYS if k in osd}


def merge_rank_states(rank_states: list[dict[str, Any]], stage: int,
                      group_shapes: list[dict[str, Any]]) -> FullOptimizerState:
    """Merge the optimizer state dicts of every saved rank (in rank order) into a :class:`FullOptimizerState`."""
    world = len(rank_states)
    numels = {name: math.prod(shape) for shapes in group_shapes for name, shape in shapes.items()}
    full = FullOptimizerState()
    for rank, osd in enumerate(rank_states):
        if rank == 0:
            full.param_groups, full.precision = saved_header(osd)
        for saved in saved_masters(osd, stage, world, rank, group_shapes):
            if rank == 0 and saved.group not in full.group_scalars:
                full.group_scalars[saved.group] = saved.scalars
            flat = saved.master.float()
            for slot in saved.slots:
                full.param_group_of[slot.name] = saved.group
                target = full.fp32.setdefault(slot.name, torch.zeros(numels[slot.name]))
                target[slot.full_offset:slot.full_offset + slot.length] = flat[slot.master_offset:slot.master_offset + slot.length]
                for key, value in saved.per_element.items():
                    moments = full.moments.setdefault(slot.name, {})
                    dest = moments.setdefault(key, torch.zeros(numels[slot.name], dtype=value.dtype))
                    dest[slot.full_offset:slot.full_offset + slot.length] = value[slot.master_offset:slot.master_offset + slot.length]
    return full


def _fill(length: int, slots: list[Any], full: StateSource, key: str | None, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(length, dtype=dtype)
    for slot in slots:
        full.copy_range(slot.name, key, slot.full_offset, out[slot.master_offset:slot.master_offset + slot.length])
    return out


def master_sizes_only(template: dict[str, Any]) -> dict[str, Any]:
    """``template`` (a strategy's ``state_dict()``) with its master tensors replaced by meta tensors of their
    sizes, all :func:`state_for_rank` reads of them: the copies a strategy's ``state_dict()`` makes are freed
    before the loaded masters are built, so a load holds one set of masters beyond the strategy's own."""
    key = "fp32_flat_groups" if "fp32_flat_groups" in template else "single_partition_of_fp32_groups"
    return {**template, key: [torch.empty(t.numel(), device="meta") for t in template[key]]}


def state_for_rank(template: dict[str, Any], full: StateSource, stage: int, world_size: int, rank: int,
                   group_shapes: list[dict[str, Any]], load_optimizer_states: bool = True) -> dict[str, Any]:
    """A state dict in the live strategy's own format (``template`` = its current ``state_dict()``) holding
    ``full`` cut to rank ``rank`` of ``world_size`` at ``stage``. With ``load_optimizer_states=False`` only
    the master weights are replaced; the optimizer keeps its current state. Only the rank's own elements are
    read from ``full`` (a :class:`StateSource`)."""
    slots, lengths = master_slots(stage, world_size, rank, group_shapes, _paddings(template))
    master_key = "fp32_flat_groups" if "fp32_flat_groups" in template else "single_partition_of_fp32_groups"
    current = optimizer_master_tensors(template)
    missing = [name for shapes in group_shapes for name in shapes if not full.has_master(name)]
    if missing:
        raise KeyError(f"the checkpoint has no value for parameter(s) {missing[:5]}")
    masters = []
    for mi, master_slots_ in enumerate(slots):
        value = _fill(lengths[mi], master_slots_, full, None, torch.float32)
        masters.append(value[: current[mi].numel()])  # stages 1-2 keep the padding out of the saved masters
    out = dict(template)
    out[master_key] = masters
    if not load_optimizer_states:
        return out
    base_key = next(k for k in BASE_OPTIMIZER_KEYS if k in template)
    base = template[base_key]
    owner = _master_to_group(base)
    groups = []
    for gi, group in enumerate(base["param_groups"]):
        saved = full.param_groups[gi] if gi < len(full.param_groups) else {}
        groups.append({**group, **saved, "params": group["params"]})
    state: dict[int, dict[str, Any]] = {}
    for mi, master_slots_ in enumerate(slots):
        names = [s.name for s in master_slots_]
        keys = sorted({k for n in names for k in full.moment_keys(n)})
        if not keys:
            continue  # the saved optimizer had not stepped yet
        entry = {k: (v.clone() if torch.is_tensor(v) else v)
                 for k, v in full.group_scalars.get(owner.get(mi, 0), {}).items()}
        for key in keys:
            dtype = next(full.moment_dtype(n, key) for n in names if key in full.moment_keys(n))
            entry[key] = _fill(lengths[mi], master_slots_, full, key, dtype)
        state[mi] = entry
    out[base_key] = {"state": state, "param_groups": groups}
    out.update(full.precision)
    return out


def fp32_as_full_state(state_dict: dict[str, torch.Tensor]) -> FullOptimizerState:
    """Master weights only (no optimizer moments), from a consolidated fp32 state dict."""
    return FullOptimizerState(fp32={k: v.reshape(-1).float() for k, v in state_dict.items()})
