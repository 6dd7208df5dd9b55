"""MoE experts in checkpoints: one file per expert, as DeepSpeed lays them out, reshardable between
expert-parallel sizes.

At ZeRO stages 0-2 the experts leave ``mp_rank_00_model_states.pt`` (which data-parallel rank 0 writes, and
which holds only rank 0's experts) and each expert goes to
``layer_{L}_expert_{G}_mp_rank_00_model_states.pt`` (L: the MoE layer's index in module order, G: the expert's
global id), keyed by its parameter names with the local expert index replaced by the global id, as
DeepSpeed writes them. Beside it dsrun writes ``layer_{L}_expert_{G}_mp_rank_00_optim_states.pt``: that
expert's fp32 master weights and optimizer state (``exp_avg``, ``exp_avg_sq`` ...) by the same names. The
first rank of each expert-data-parallel group writes its experts' files.

Loading puts every rank's own experts back by global id, whatever expert-parallel size, data-parallel size
and stage (0-2) saved them: the module's expert parameters from the model files, the experts' master
weights and optimizer state from the optimizer files, and the shared groups merged from every saved rank
(:mod:`.reshard`). Stages 1-2 with the saved topology read each rank's own optimizer file as usual; ZeRO-3
keeps its per-rank files (experts included), writes no expert files and loads with the saved topology only.
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


def _split_dense(saved_shapes: list[dict[str, Any]], where: Path) -> int:
    """How many leading groups hold shared parameters (expert groups must come after them, as
    ``split_params_into_different_moe_groups_for_optimizer`` puts them)."""
    kinds = [any(MARK in name for name in shapes) for shapes in saved_shapes]
    dense = kinds.index(True) if True in kinds else len(kinds)
    if any(not k for k in kinds[dense:]):
        raise RuntimeError(f"{where}: expert param groups must follow the shared ones to reshard MoE state")
    return dense


def optimizer_state(engine: Any, tag_dir: Path, saved_shapes: list[dict[str, Any]],
                    rank_states: list[dict[str, Any]], saved_stage: int, load_optimizer_states: bool = True
                    ) -> dict[str, Any]:
    """This rank's optimizer state for any saved expert-parallel size and stage 0-2: the shared groups merged
    from every saved rank and cut as this run lays them out (:mod:`.reshard`), each expert group rebuilt from
    the per-expert files by global id and cut over its own expert-data-parallel group."""
    from . import reshard

    strategy = engine.strategy
    dense = _split_dense(saved_shapes, tag_dir)
    full = reshard.merge_rank_states(rank_states, saved_stage, saved_shapes[:dense])
    full.param_groups = [{k: v for k, v in g.items() if k != "params"}
                         for g in reshard._base_state(rank_states[0])["param_groups"]]
    for li, g, local, params in _experts(engine):
        saved = load_file(tag_dir / optim_file(li, g))
        for name in params:
            local_name = local + name.split(MARK, 1)[1].split(".", 1)[1]
            full.fp32[local_name] = saved["fp32"][name].reshape(-1).float()
            full.moments[local_name] = {k: v.reshape(-1) for k, v in saved["optimizer_state"][name].items()
                                        if torch.is_tensor(v) and v.dim() > 0}
    template = strategy.state_dict()
    live_shapes = strategy.checkpoint_param_shapes()
    base_key = next(k for k in ("base_optimizer_state", "optimizer_state_dict") if k in template)
    masters, states, param_groups = [], {}, []
    for gi, group in enumerate(strategy.groups):
        base = template[base_key]
        sub = {**template, "single_partition_of_fp32_groups": [template["single_partition_of_fp32_groups"][gi]],
               base_key: {"state": {0: base["state"][gi]} if gi in base["state"] else {},
                          "param_groups": [{**base["param_groups"][gi], "params": [0]}]}}
        cut = reshard.state_for_rank(sub, full, strategy.stage, group.world_size if strategy.partitioned else 1,
                                     group.rank if strategy.partitioned else 0, [live_shapes[gi]],
                                     load_optimizer_states=load_optimizer_states)
        masters.append(cut["single_partition_of_fp32_groups"][0])
        if 0 in cut[base_key]["state"]:
            states[gi] = cut[base_key]["state"][0]
        saved_group = full.param_groups[gi] if gi < len(full.param_groups) else {}
        param_groups.append({**base["param_groups"][gi],
                             **{k: v for k, v in saved_group.items() if k not in ("name", "moe")},
                             "params": base["param_groups"][gi]["params"]})
    out = {**template, **full.precision, "single_partition_of_fp32_groups": masters}
    if load_optimizer_states:
        out[base_key] = {"state": states, "param_groups": param_groups}
    return out
