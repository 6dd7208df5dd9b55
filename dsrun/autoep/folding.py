"""AutoEP over AutoTP ("folding"): the per-stage layout of tensor-, data-, expert- and expert-data-parallel ranks.

Within one pipeline stage of ``stage_size`` ranks, AutoTP groups ``tp_size`` consecutive ranks (the dense
data-parallel groups are the ranks at the same position of each TP group), and AutoEP groups ``ep_size``
consecutive ranks (an expert-parallel group may span TP lanes); the ranks at the same position of each EP group
hold the same experts (expert-data-parallel). Everything here is arithmetic on sizes and ranks except
:func:`reduce_autoep_folding_gradient`, which reduces one gradient over the TP group by its parameter family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

AUTOEP_FOLDING_PARAM_FAMILY_ATTR = "ds_autoep_folding_param_family"
AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM = "router_gate_replicated"
AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM = "router_gate_partial"
AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM = "sp_sharded_layernorm"
AUTOEP_FOLDING_GRAD_CORRECTED_ATTR = "ds_autoep_folding_grad_corrected"
AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
# routed experts: divide out the TP factor the folded combine's all-gather puts on their gradient, no TP reduction
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"


@dataclass(frozen=True)
class ParallelFoldingSpec:
    world_size: int
    pp_size: int
    stage_size: int
    tp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    mp_mode: str = "tp"


@dataclass(frozen=True)
class FoldingGroupTables:
    """Every group of each kind, as tuples of global ranks."""
    tp_groups: tuple[tuple[int, ...], ...]
    dense_dp_groups: tuple[tuple[int, ...], ...]
    ep_groups: tuple[tuple[int, ...], ...]
    edp_groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class FoldingGroupHandles:
    """This rank's process groups of each kind (and their ranks) once they exist."""
    spec: ParallelFoldingSpec
    tp_group: object
    dense_dp_group: object
    ep_group: object
    edp_group: object
    ep_group_name: str
    tp_ranks: tuple[int, ...]
    dense_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def build_folding_spec(*, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1,
                       mp_mode: str = "tp") -> ParallelFoldingSpec:
    """The sizes of one stage's groups; raises ValueError naming the size that does not tile."""
    for name, value in (("world_size", world_size), ("pp_size", pp_size), ("tensor_parallel.autotp_size", tp_size),
                        ("expert_parallel.autoep_size", ep_size),
                        ("expert_parallel.expert_tensor_parallel_size", etp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % pp_size:
        raise ValueError(f"pp_size={pp_size} must divide world_size={world_size}. "
                         f"Valid pp_size values: {_divisors(world_size)}")
    stage = world_size // pp_size
    where = f"the stage size (world_size={world_size} / pp_size={pp_size} = {stage})"
    if stage % tp_size:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} must divide {where}. Computed dp would be "
                         f"non-integral. Valid autotp_size values: {_divisors(stage)}")
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(f"expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size "
                         f"({ep_size} * {etp_size} = {width}) must divide {where}. Computed edp would be "
                         f"non-integral. Valid expert-width values: {_divisors(stage)}")
    return ParallelFoldingSpec(world_size=world_size, pp_size=pp_size, stage_size=stage, tp_size=tp_size,
                               dp_size=stage // tp_size, ep_size=ep_size, etp_size=etp_size, edp_size=stage // width,
                               mp_mode=mp_mode)


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """All TP, dense-DP, EP and EDP groups of ``spec``, stage by stage (no process groups needed)."""
    tp, dense, ep, edp = [], [], [], []
    for first in range(0, spec.world_size, spec.stage_size):
        ranks = tuple(range(first, first + spec.stage_size))
        tp += [ranks[i:i + spec.tp_size] for i in range(0, spec.stage_size, spec.tp_size)]
        dense += [ranks[lane::spec.tp_size] for lane in range(spec.tp_size)]
        stage_ep = [ranks[i:i + spec.ep_size] for i in range(0, spec.stage_size, spec.ep_size)]
        ep += stage_ep
        edp += [tuple(group[pos] for group in stage_ep) for pos in range(spec.ep_size)]
    return FoldingGroupTables(tuple(tp), tuple(dense), tuple(ep), tuple(edp))


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple[int, ...]]:
    """The ranks of ``global_rank``'s own group of each kind (``tp``, ``dense_dp``, ``ep``, ``edp``)."""
    tables = expected_folding_group_tables(spec)
    kinds = {"tp": tables.tp_groups, "dense_dp": tables.dense_dp_groups, "ep": tables.ep_groups,
             "edp": tables.edp_groups}
    return {kind: next(g for g in groups if global_rank in g) for kind, groups in kinds.items()}


def _mpu_size(mpu, *getters: str) -> int | None:
    for name in getters:
        getter = getattr(mpu, name, None) if mpu is not None else None
        if getter is not None:
            return getter()
    return None


def validate_folding_global(spec: ParallelFoldingSpec, *, zero_stage: int = 0, sp_size: int = 1,
                            deepcompile_enabled: bool = False, use_data_before_expert_parallel: bool = False,
                            mpu=None, autoep_enabled: bool = True, tp_preset: str | None = None,
                            ep_preset: str | None = None, zero_offload_optimizer: bool = False,
                            zero_offload_param: bool = False) -> None:
    """Refuse the combinations AutoEP does not support (ValueError), before any group is made."""
    if not autoep_enabled:
        return
    folded = spec.tp_size > 1
    if deepcompile_enabled and folded:
        raise ValueError("DeepCompile with AutoEP+AutoTP folding is not supported; disable compile.deepcompile "
                         "or use non-folded AutoEP with tensor_parallel.autotp_size=1.")
    if folded and spec.pp_size > 1:
        raise ValueError(f"AutoEP+AutoTP folding currently supports pp_size=1 only; got pp_size={spec.pp_size}.")
    if folded and sp_size > 1:
        raise ValueError("tensor_parallel.autotp_size and Ulysses sequence parallelism are mutually exclusive "
                         f"for AutoEP folding (autotp_size={spec.tp_size}, sp_size={sp_size}).")
    if spec.etp_size != 1:
        raise ValueError(f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} is reserved for "
                         "expert-internal tensor parallelism and is not supported yet: use "
                         "expert_tensor_parallel_size=1.")
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ValueError("tensor_parallel.preset_model and expert_parallel.preset_model must match when both are "
                         f"set (tensor_parallel.preset_model={tp_preset!r}, expert_parallel.preset_model="
                         f"{ep_preset!r}).")
    if folded and spec.ep_size == 1:
        raise ValueError("AutoEP+AutoTP folding requires expert_parallel.autoep_size > 1: with ep=1 every TP lane "
                         "would compute (and count the gradient of) the same routed tokens.")
    if folded and use_data_before_expert_parallel:
        raise ValueError("use_data_before_expert_parallel_ is not supported with AutoEP+AutoTP folding; "
                         "disable use_data_before_expert_parallel_.")
    if folded and zero_stage == 3:
        raise ValueError("AutoEP+AutoTP with ZeRO stage 3 is reserved for the separate ZeRO-3 composition lane; "
                         "use ZeRO stage 0, 1 or 2 with folding.")
    if folded and (zero_offload_optimizer or zero_offload_param):
        raise ValueError("ZeRO optimizer/parameter offload with AutoEP+AutoTP folding is not validated; "
                         "disable offload.")
    mpu_tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if mpu_tp not in (None, 1, spec.tp_size):
        raise ValueError(f"mpu tensor/model parallel world size ({mpu_tp}) conflicts with "
                         f"tensor_parallel.autotp_size={spec.tp_size}.")
    mpu_pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipeline_parallel_world_size")
    if mpu_pp not in (None, spec.pp_size):
        raise ValueError(f"mpu pipeline parallel world size ({mpu_pp}) conflicts with pp_size={spec.pp_size}.")


def mark_autoep_folding_router_parameter(param) -> None:
    """The router runs identically on every TP peer: its TP reduction is an average."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM)


def mark_autoep_folding_partial_router_parameter(param) -> None:
    """A router whose token work is split across peers (each holds a partial gradient): summed."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM)


def mark_autoep_folding_sp_sharded_layernorm_parameter(param) -> None:
    """A LayerNorm over a sequence-sharded activation: summed under sequence parallelism, else averaged."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM)


def autoep_folding_gradient_reduction_strategy(folding_spec: ParallelFoldingSpec | None, param, *,
                                               param_name: str | None = None) -> str:
    """How one gradient is reduced over the TP group: ``skip``, ``sum``, ``average`` or ``expert_tp_cancel``."""
    if folding_spec is None or getattr(folding_spec, "tp_size", 1) <= 1:
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP  # TP-sharded: the TP path owns it
    if hasattr(param, "allreduce") and not param.allreduce:
        return AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL  # routed expert
    family = getattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, None)
    if family is None and param_name is not None and ".router." in param_name:
        family = AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM
    mp_mode = getattr(folding_spec, "mp_mode", "tp")
    if family == AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM and mp_mode in ("tp", "sp"):
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    if family == AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM and mp_mode == "sp":
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    return AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE


def reduce_autoep_folding_gradient(folding_spec: ParallelFoldingSpec | None, param, grad, *, tp_group,
                                   param_name: str | None = None) -> str:
    """Reduce ``grad`` in place over ``tp_group`` by the parameter's strategy (in fp32); returns the strategy."""
    strategy = autoep_folding_gradient_reduction_strategy(folding_spec, param, param_name=param_name)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_SKIP or grad is None or grad.data.is_sparse:
        return strategy
    from dsrun import comm as dist

    data = grad.data
    tp_world = dist.get_world_size(group=tp_group)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL:
        if tp_world > 1:
            data.div_(tp_world)
        return strategy
    reduced = data if data.dtype == torch.float32 else data.float()
    dist.all_reduce(reduced, group=tp_group)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE:
        reduced.div_(tp_world)
    if reduced is not data:
        data.copy_(reduced.to(data.dtype))
    return strategy


def is_autoep_folding_gradient_corrected(param) -> bool:
    return bool(getattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, False))


def clear_autoep_folding_gradient_corrected(param) -> None:
    if hasattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR):
        setattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, False)


def apply_folding_correction_to_grad_buffer(folding_spec: ParallelFoldingSpec | None, param, grad, *, tp_group,
                                            param_name: str | None = None,
                                            use_correction_marker: bool = True) -> str:
    """:func:`reduce_autoep_folding_gradient` once per gradient (a marker on the parameter skips a second time)."""
    if use_correction_marker and is_autoep_folding_gradient_corrected(param):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    strategy = reduce_autoep_folding_gradient(folding_spec, param, grad, tp_group=tp_group, param_name=param_name)
    if use_correction_marker and strategy != AUTOEP_FOLDING_GRAD_REDUCE_SKIP:
        setattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, True)
    return strategy


def _rank_groups(groups: Iterable[Iterable[int]]) -> set[tuple[int, ...]]:
    return {tuple(int(r) for r in g) for g in groups}


def assert_group_matches_spec(existing_rank_lists, spec: ParallelFoldingSpec, *, group_kind: str = "ep_edp") -> None:
    """RuntimeError if cached ``ep_size_N`` EP/EDP rank lists are not groups of ``spec``'s layout."""
    tables = expected_folding_group_tables(spec)
    if isinstance(existing_rank_lists, dict):
        observed_ep, observed_edp = existing_rank_lists.get("ep", []), existing_rank_lists.get("edp", [])
    else:
        observed_ep, observed_edp = existing_rank_lists
    for kind, observed, expected in (("expert-parallel", observed_ep, tables.ep_groups),
                                     ("expert-data-parallel", observed_edp, tables.edp_groups)):
        for group in _rank_groups(observed) - _rank_groups(expected):
            raise RuntimeError(f"Cached {kind} group {group} does not match folding spec {spec}.")
