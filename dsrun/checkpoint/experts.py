"""Parameters that features checkpoint in files of their own (``Feature.parameter_files()``,
:class:`dsrun.features.ParameterFiles`): MoE's experts, one pair of files per expert, as DeepSpeed lays them out,
reshardable between expert-parallel sizes (the feature, ``dsrun/moe/feature.py``, names the files and says
which parameters go there).

At every ZeRO stage those parameters leave the model-states files (``mp_rank_00_model_states.pt``, which
data-parallel rank 0 writes at stages 0-2 and which would hold only rank 0's experts; each rank's
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` at stage 3) and each expert goes to its model file (DeepSpeed's
``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``) keyed by its saved names (the local expert index replaced by
the global id). Beside it dsrun writes its optimizer file (``..._optim_states.pt``): that expert's whole fp32
master weights and optimizer state (``exp_avg``, ``exp_avg_sq`` ...) by the same names, gathered from the ranks
its masters are cut over (its expert-data-parallel group: stages 1-2 cut the flat group, stage 3 every
parameter). The rank the feature marks ``writer`` (the first of each expert-data-parallel group) writes them.

Loading puts every rank's own experts back by saved name, whatever expert-parallel size, data-parallel size
and stage (0-3) saved them: the module's parameters from the model files, their master weights and optimizer
state from the optimizer files, and the shared groups merged from every saved rank (:mod:`.reshard`). With the
saved topology each rank reads its own optimizer file as usual (the experts' state is in it too).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsrun import comm
from dsrun.moe.feature import MARK
from dsrun.utils.zero_to_fp32 import master_slots

from . import atomic
from .engine_view import CheckpointEngine
from .safe_load import load_file
from .tensor_file import TensorFile

if TYPE_CHECKING:
    from dsrun.features import ParameterFiles

    from .reshard import StateSource

__all__ = ["MARK", "without_experts", "whole_master_state", "expert_states", "save", "module_state",
           "optimizer_state"]  # MARK: DeepSpeed's expert parameter names hold it (tools filter by it)


def without_experts(engine: CheckpointEngine, module_sd: dict[str, Any]) -> dict[str, Any]:
    """The module state the main model-states file keeps (DeepSpeed's non-MoE state dict)."""
    owns = engine.features.owns_checkpoint_name
    return {k: v for k, v in module_sd.items() if not owns(k)}


def whole_master_state(engine: CheckpointEngine, mi: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]],
                                                       dict[str, Any]]:
    """Master tensor ``mi``'s parameters by (local) name: their whole fp32 master values and optimizer moments
    (flat), gathered over the ranks the master is cut over (a collective among them, any stage), and the
    master's scalar optimizer state (``step``)."""
    strategy = engine.strategy
    world, _, group = strategy.master_partitions()[mi]
    shapes = strategy.checkpoint_param_shapes()[mi]
    master = strategy.masters[mi].detach()
    state = strategy.optimizer.state.get(strategy.masters[mi], {})
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and v.numel() == master.numel()}
    scalars = {k: v for k, v in state.items() if k not in tensors}
    pieces = {None: master.float().contiguous(), **{k: v.contiguous() for k, v in tensors.items()}}
    if world > 1:
        for key, t in pieces.items():
            out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
            comm.all_gather_into_tensor(out, t, group=group)
            pieces[key] = out
    values: dict[Any, dict[str, torch.Tensor]] = {key: {} for key in pieces}
    for r in range(world):
        gaps = strategy.param_alignment_paddings  # zero_optimization.parameter_alignment's, per master
        slots, _ = master_slots(strategy.stage, world, r, [shapes], None if gaps is None else [gaps[mi]])
        for key, t in pieces.items():
            own = t[r * master.numel():(r + 1) * master.numel()].cpu()
            for slot in slots[0]:
                whole = values[key].setdefault(slot.name, torch.zeros(math.prod(shapes[slot.name]), dtype=t.dtype))
                lo, n = slot.master_offset, slot.length
                whole[slot.full_offset:slot.full_offset + n] = own[lo:lo + n]
    moments = {name: {k: values[k][name] for k in tensors} for name in values[None]}
    return values[None], moments, scalars


def expert_states(engine: CheckpointEngine) -> dict[str, dict[str, Any]]:
    """This rank's experts by global parameter name: ``weight`` (the model's value), ``fp32`` (the master) and
    the optimizer state (``exp_avg`` ... and scalars), whole. Collective within every expert-data group."""
    files = engine.features.parameter_files()
    if not files:
        return {}
    strategy = engine.strategy
    local_to_master = {name: mi for mi, shapes in enumerate(strategy.checkpoint_param_shapes()) for name in shapes}
    wanted = sorted({local_to_master[local] for unit in files for local in unit.local_names.values()})
    whole = {mi: whole_master_state(engine, mi) for mi in wanted}  # masters in order: every member calls alike
    out = {}
    for unit in files:
        for name, p in unit.params.items():
            key, shape = unit.local_names[name], getattr(p, "ds_shape", p.shape)  # stage 3: the full shape
            fp32, moments, scalars = whole[local_to_master[key]]
            out[name] = {"weight": strategy.full_param_value(p), "fp32": fp32[key].view(shape),
                         **{k: v.view(shape) for k, v in moments[key].items()}, **scalars}
    return out


def save(engine: CheckpointEngine, staging: Path, rank: int) -> None:
    """Write this rank's expert files (each one's ``writer`` rank writes; every rank holding them calls)."""
    states = expert_states(engine)
    for unit in engine.features.parameter_files():
        if not unit.writer:
            continue
        atomic.save_torch({name: states[name]["weight"] for name in unit.params}, staging / unit.model_file, rank)
        fp32 = {name: states[name]["fp32"] for name in unit.params}
        optimizer_state = {name: {k: v for k, v in states[name].items() if k not in ("weight", "fp32")}
                           for name in unit.params}
        atomic.save_torch({"fp32": fp32, "optimizer_state": optimizer_state}, staging / unit.optim_file, rank)


def module_state(engine: CheckpointEngine, tag_dir: Path, module_sd: dict[str, Any], unread: bool = False
                 ) -> dict[str, Any]:
    """``module_sd`` with this rank's experts added back (local names) from their files; ``unread``: left unread
    (on the meta device), for :func:`.partial_state.read_module_into` to read into the live experts."""
    out = without_experts(engine, module_sd)
    for unit in engine.features.parameter_files():
        if not (tag_dir / unit.model_file).is_file():
            raise FileNotFoundError(f"{tag_dir}: no {unit.model_file}: this MoE checkpoint has no per-expert "
                                    "files (an older dsrun saved ZeRO-3 without them); load it with the dsrun that "
                                    "saved it, at the saved topology")
        if unread:
            with TensorFile(tag_dir / unit.model_file) as file:
                saved = file.objects
        else:
            saved = load_file(tag_dir / unit.model_file)
        for name, local in unit.local_names.items():
            out[local] = saved[name]
    return out


def _split_dense(engine: CheckpointEngine, saved_shapes: list[dict[str, Any]], where: Path) -> int:
    """How many leading groups hold shared parameters (expert groups must come after them, as
    ``split_params_into_different_moe_groups_for_optimizer`` puts them)."""
    owns = engine.features.owns_checkpoint_name
    kinds = [any(owns(name) for name in shapes) for shapes in saved_shapes]
    dense = kinds.index(True) if True in kinds else len(kinds)
    if any(not k for k in kinds[dense:]):
        raise RuntimeError(f"{where}: expert param groups must follow the shared ones to reshard MoE state")
    return dense


class _ExpertFiles:
    """This rank's experts' optimizer files as a :class:`.reshard.StateSource` by local name (their masters and
    per-element states read by range), the shared groups' state (``shared``) under every other name."""

    def __init__(self, tag_dir: Path, units: list[ParameterFiles], shared: StateSource) -> None:
        self.shared, self.group_scalars = shared, shared.group_scalars
        self.param_groups, self.precision = shared.param_groups, shared.precision
        self.files: list[TensorFile] = []
        self.entries: dict[str, tuple[TensorFile, torch.Tensor, dict[str, torch.Tensor]]] = {}
        for unit in units:
            file = TensorFile(tag_dir / unit.optim_file)
            self.files.append(file)
            for name, local in unit.local_names.items():
                moments = {k: v for k, v in file.objects["optimizer_state"][name].items()
                           if torch.is_tensor(v) and v.dim() > 0}
                self.entries[local] = (file, file.objects["fp32"][name], moments)

    def close(self) -> None:
        for file in self.files:
            file.close()

    def has_master(self, name: str) -> bool:
        return name in self.entries or self.shared.has_master(name)

    def moment_keys(self, name: str) -> set[str]:
        return set(self.entries[name][2]) if name in self.entries else self.shared.moment_keys(name)

    def moment_dtype(self, name: str, key: str) -> torch.dtype:
        return self.entries[name][2][key].dtype if name in self.entries else self.shared.moment_dtype(name, key)

    def copy_range(self, name: str, key: str | None, full_offset: int, out: torch.Tensor) -> None:
        if name not in self.entries:
            self.shared.copy_range(name, key, full_offset, out)
            return
        file, fp32, moments = self.entries[name]
        file.read(fp32 if key is None else moments[key], full_offset, out)


def optimizer_state(engine: CheckpointEngine, tag_dir: Path, saved_shapes: list[dict[str, Any]],
                    model_states: dict[str, Any], saved_stage: int, saved_world: int, model_path: Path,
                    load_optimizer_states: bool = True) -> dict[str, Any]:
    """This rank's optimizer state for any saved expert-parallel size and stage: the shared groups' state (every
    saved rank's, read by range; a stage-0 save's from its model states file ``model_path``, by range where
    ``model_states`` left it unread) and each of this rank's experts' from its file by global id (read by range),
    cut as this run lays them out (:mod:`.reshard`); every master tensor is cut over the ranks it is partitioned
    over (``strategy.master_partitions()``: the data-parallel group, or an expert-data-parallel group)."""
    from . import partial_state, reshard
    from .saved_tag import stage0_state

    dense = _split_dense(engine, saved_shapes, tag_dir)
    with contextlib.ExitStack() as opened:
        if saved_stage > 0 or partial_state.left_unread(model_states):
            shared: Any = opened.enter_context(partial_state.saved_state(
                tag_dir, model_path, saved_stage, saved_world, saved_shapes[:dense], False, engine.bfloat16_enabled()))
        else:
            shared = reshard.merge_rank_states([stage0_state(model_states, None)], 0, saved_shapes[:dense])
        full = _ExpertFiles(tag_dir, engine.features.parameter_files(), shared)
        opened.callback(full.close)
        return _cut_masters(engine, full, load_optimizer_states)


def _cut_masters(engine: CheckpointEngine, full: StateSource, load_optimizer_states: bool) -> dict[str, Any]:
    from . import reshard

    strategy = engine.strategy
    template = reshard.master_sizes_only(strategy.state_dict())  # its masters' sizes: no clone of them for the cut
    live_shapes = strategy.checkpoint_param_shapes()
    master_key = next(k for k in ("fp32_flat_groups", "single_partition_of_fp32_groups") if k in template)
    base_key = next(k for k in ("base_optimizer_state", "optimizer_state_dict") if k in template)
    base = template[base_key]
    owner = reshard._master_to_group(base)  # master tensor -> its param group (stage 3: several per group)
    masters, states = [], {}
    gaps = template.get("param_alignment_paddings")  # zero_optimization.parameter_alignment's, per master
    for mi, (world, rank, _) in enumerate(strategy.master_partitions()):
        sub = {**template, master_key: [template[master_key][mi]],
               base_key: {"state": {0: base["state"][mi]} if mi in base["state"] else {},
                          "param_groups": [{**base["param_groups"][owner[mi]], "params": [0]}]},
               **({"param_alignment_paddings": [gaps[mi]]} if gaps else {})}
        cut = reshard.state_for_rank(sub, full, strategy.stage, world, rank, [live_shapes[mi]],
                                     load_optimizer_states=load_optimizer_states)
        masters.append(cut[master_key][0])
        if 0 in cut[base_key]["state"]:
            states[mi] = cut[base_key]["state"][0]
    param_groups = [{**group, **{k: v for k, v in saved.items() if k not in ("name", "moe")}, "params": group["params"]}
                    for group, saved in zip(base["param_groups"], full.param_groups + [{}] * len(base["param_groups"]))]
    out = {**template, **full.precision, master_key: masters}
    if load_optimizer_states:
        out[base_key] = {"state": states, "param_groups": param_groups}
    return out
