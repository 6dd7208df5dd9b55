"""MoE experts in checkpoints: one file per expert, as DeepSpeed lays them out, reshardable between
expert-parallel sizes.

At ZeRO stages 0-2 the experts leave ``mp_rank_00_model_states.pt`` (which data-parallel rank 0 writes, and
which holds only rank 0's experts) and each expert goes to
``layer_{L}_expert_{G}_mp_rank_00_model_states.pt`` (L: the MoE layer's index in module order, G: the expert's
global id), keyed by its parameter names with the local expert index replaced by the global id, as
DeepSpeed writes them. Beside it dsrun writes ``layer_{L}_expert_{G}_mp_rank_00_optim_states.pt``: that
expert's fp32 master weights and optimizer state (``exp_avg``, ``exp_avg_sq`` ...) by the same names. The
first rank of each expert-data-parallel group writes its experts' files.

Loading puts every rank's own experts back by global id, whatever expert-parallel size saved them: the
module's expert parameters from the model files and, at stage 0, the experts' master weights and optimizer
state from the optimizer files (the shared groups come from the saved optimizer state as usual). Stages 1-2
restore from their per-rank optimizer files, which needs the same topology; ZeRO-3 keeps its per-rank files
(experts included) and writes no expert files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dsrun import comm
from dsrun.moe.layer import MoE
from dsrun.moe.utils import is_moe_param

from . import atomic
from .safe_load import load_file

MARK = ".deepspeed_experts."


def model_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_optim_states.pt"


def applies(engine: Any) -> bool:
    """Expert files are written and read for MoE models at stages 0-2."""
    return bool(getattr(engine, "has_moe_layers", False)) and engine.strategy is not None and \
        engine.strategy.stage in (0, 1, 2)


def _experts(engine: Any) -> list[tuple[int, int, str, dict[str, torch.nn.Parameter]]]:
    """(layer index, global expert id, prefix of its parameter names, {global name: param}) for this rank."""
    out = []
    prefixes = {id(m): name for name, m in engine.module.named_modules()}
    layers = [m for m in engine.module.modules() if isinstance(m, MoE)]
    for li, layer in enumerate(layers):
        base = prefixes[id(layer)]
        local_prefix = (base + "." if base else "") + "deepspeed_moe.experts.deepspeed_experts."
        for j, (g, expert) in enumerate(zip(layer.global_expert_ids(), layer.deepspeed_moe.experts.deepspeed_experts)):
            params = {f"{local_prefix}{g}.{name}": p for name, p in expert.named_parameters()}
            out.append((li, g, f"{local_prefix}{j}.", params))
    return out


def to_global_name(engine: Any) -> dict[str, str]:
    """This rank's local expert parameter names -> their global names."""
    mapping = {}
    for _, g, local, params in _experts(engine):
        for name in params:
            tail = name.split(MARK, 1)[1].split(".", 1)[1]
            mapping[local + tail] = name
    return mapping


def without_experts(module_sd: dict[str, Any]) -> dict[str, Any]:
    """The module state the main model-states file keeps (DeepSpeed's non-MoE state dict)."""
    return {k: v for k, v in module_sd.items() if MARK not in k}


def _flat_state(engine: Any, gi: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """Group ``gi``'s whole fp32 master and optimizer-state tensors (stages 1-2: gathered over the group's
    ranks, a collective among them), plus its scalar state."""
    strategy = engine.strategy
    group = strategy.groups[gi]
    master = strategy.masters[gi].detach()
    state = strategy.optimizer.state.get(strategy.masters[gi], {})
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and v.numel() == master.numel()}
    scalars = {k: v for k, v in state.items() if k not in tensors}

    def whole(t: torch.Tensor) -> torch.Tensor:
        if not strategy.partitioned or group.world_size == 1:
            return t.float()
        out = torch.empty(group.padded_numel, dtype=torch.float32, device=t.device)
        comm.all_gather_into_tensor(out, t.float().contiguous(), group=group.process_group)
        return out

    return whole(master), {k: whole(v) for k, v in tensors.items()}, scalars


def _slots(engine: Any) -> dict[int, tuple[int, int, int]]:
    """id(param) -> (group index, offset, numel) in the strategy's flat groups."""
    out = {}
    for gi, group in enumerate(engine.strategy.groups):
        for p, off, n in zip(group.params, group.offsets, group.numels):
            out[id(p)] = (gi, off, n)
    return out


def save(engine: Any, staging: Path, rank: int) -> None:
    """Write this rank's expert files (the first rank of each expert-data group writes; every rank calls)."""
    slots = _slots(engine)
    expert_groups = sorted({slots[id(p)][0] for *_, params in _experts(engine) for p in params.values()})
    flats = {gi: _flat_state(engine, gi) for gi in expert_groups}  # collective within each group
    for li, g, _, params in _experts(engine):
        members = engine.groups.members_of_param(next(iter(params.values())))
        if engine.global_rank != members[0]:
            continue
        weights = {name: p.detach().cpu().clone() for name, p in params.items()}
        atomic.save_torch(weights, staging / model_file(li, g), rank)
        fp32, states = {}, {}
        for name, p in params.items():
            gi, off, n = slots[id(p)]
            master, tensors, scalars = flats[gi]
            fp32[name] = master[off:off + n].view(p.shape).cpu().clone()
            states[name] = {**{k: v[off:off + n].view(p.shape).cpu().clone() for k, v in tensors.items()},
                            **scalars}
        atomic.save_torch({"fp32": fp32, "optimizer_state": states}, staging / optim_file(li, g), rank)


def module_state(engine: Any, tag_dir: Path, module_sd: dict[str, Any]) -> dict[str, Any]:
    """``module_sd`` with this rank's experts added back (local names) from their files."""
    out = without_experts(module_sd)
    for li, g, local, params in _experts(engine):
        saved = load_file(tag_dir / model_file(li, g))
        for name in params:
            tail = name.split(MARK, 1)[1].split(".", 1)[1]
            out[local + tail] = saved[name]
    return out


def stage0_optimizer_state(engine: Any, tag_dir: Path, saved: dict[str, Any]) -> dict[str, Any]:
    """The stage-0 optimizer state for this rank: shared groups from the saved state (rank 0's), expert
    groups rebuilt from the per-expert files by global name."""
    strategy = engine.strategy
    live = strategy.state_dict()
    if len(saved["single_partition_of_fp32_groups"]) != len(strategy.groups):
        raise RuntimeError(f"{tag_dir}: the checkpoint has {len(saved['single_partition_of_fp32_groups'])} "
                           f"optimizer groups, this model {len(strategy.groups)}")
    names = {id(p): n for _, _, _, params in _experts(engine) for n, p in params.items()}
    files: dict[tuple[int, int], dict[str, Any]] = {}
    owner = {id(p): (li, g) for li, g, _, params in _experts(engine) for p in params.values()}
    masters, states = [], {}
    saved_states = saved["base_optimizer_state"]["state"]
    for gi, group in enumerate(strategy.groups):
        if not any(is_moe_param(p) for p in group.params):
            masters.append(saved["single_partition_of_fp32_groups"][gi])
            if gi in saved_states:
                states[gi] = saved_states[gi]
            continue
        master = torch.zeros(group.numel, dtype=torch.float32)
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for p, off, n in zip(group.params, group.offsets, group.numels):
            key = owner[id(p)]
            if key not in files:
                files[key] = load_file(tag_dir / optim_file(*key))
            master[off:off + n] = files[key]["fp32"][names[id(p)]].reshape(-1)
            for k, v in files[key]["optimizer_state"][names[id(p)]].items():
                if torch.is_tensor(v) and v.numel() == n and v.dim() > 0:
                    tensors.setdefault(k, torch.zeros(group.padded_numel, dtype=torch.float32))[off:off + n] = \
                        v.reshape(-1)
                else:
                    scalars[k] = v
        masters.append(master)
        if tensors or scalars:
            states[gi] = {**scalars, **tensors}
    groups_saved = saved["base_optimizer_state"]["param_groups"]
    groups_live = live["base_optimizer_state"]["param_groups"]
    param_groups = [{**s, **{k: l[k] for k in ("name", "moe", "params") if k in l}}
                    for s, l in zip(groups_saved, groups_live)]
    return {**saved, "single_partition_of_fp32_groups": masters, "group_paddings": live["group_paddings"],
            "param_shapes": live["param_shapes"], "partition_count": live["partition_count"],
            "base_optimizer_state": {"state": states, "param_groups": param_groups}}
