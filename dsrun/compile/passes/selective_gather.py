"""Selective gather (DeepSpeed's ``selective_gather``): keep gathered the parameters that fit in the memory the
profile leaves free, so each is all-gathered once per optimizer step instead of at every use.

Runs once, on the first backward graph in the graph order. The budget (:func:`_compute_persistence_budget`): the
device's memory less a 10% margin, less the highest transient peak any profiled graph reached (parameters
kept gathered stay resident through every op's temporaries); the smallest of every rank's figures. Candidates
are taken by gather time per byte, slowest first (the handle's measured all-gathers; in graph order when none
was timed) while they fit, and handed to the handle's ``set_persistent``. A profile that did not cover a
whole graph, no profile, no candidate or no headroom: nothing changes.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from dsrun import comm as dist  # DeepSpeed's module name (its tests patch it)
from dsrun.accelerator import get_accelerator
from dsrun.compile.handle import get_deepcompile_handle
from dsrun.compile.util import print_rank_0, reduce_over_ranks
from dsrun.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract
from dsrun.compile.profilers import ProfilingResult
from dsrun.compile.profilers.graph_profile import is_profile_incomplete

NAME = "selective_gather"
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))
MEM_MARGIN = 0.1


def _compute_persistence_budget(all_graph_mem_records: list[list[tuple[str, int, int, int]]], total_mem: int,
                                mem_margin: float) -> dict[str, int]:
    """``usable_mem`` (total less the margin), the highest resident and transient figures over the records,
    and ``available_mem``: what persistent parameters may take (never below zero)."""
    usable = int(total_mem * (1 - mem_margin))
    lists = [records for records in all_graph_mem_records if records]
    resident = max((r[1] for records in lists for r in records), default=0)
    transient = max((r[3] for records in lists for r in records), default=0)
    return {"usable_mem": usable, "peak_resident_alloc": resident, "transient_peak": transient,
            "available_mem": max(0, usable - transient) if lists else 0, "profiled_list_count": len(lists)}


def _incomplete(result: ProfilingResult) -> bool:
    return (is_profile_incomplete(result.fwd_graph) or is_profile_incomplete(result.bwd_graph)
            or not result.fwd_mem_complete or (result.needs_backward and not result.bwd_mem_complete))


def selective_gather(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results,
                     create_inputs_fn, mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    first_backward = next((g for g, needs_backward in graph_order if needs_backward), None)
    if not bwd or graph_id != first_backward:
        return gm
    if any(_incomplete(r) for r in profiling_results.values()):
        print_rank_0(f"selective_gather graph_id={graph_id}: incomplete profiling data; persistence unchanged")
        return gm
    records = [mem for r in profiling_results.values() for mem in (r.fwd_mem, r.bwd_mem)]
    size: dict[int, int] = {}
    already: set[int] = set()
    for manager in param_manager.values():
        for name, info in manager.params.items():
            ds_id = manager.ds_ids[name]
            size[ds_id] = info.numel * info.dtype.itemsize
            if info.param.ds_persist:
                already.add(ds_id)
    handle = get_deepcompile_handle()
    seconds = getattr(handle, "gather_seconds", {})
    candidates = [d for d in size if d not in already]
    candidates.sort(key=lambda d: seconds.get(d, 0.0) / size[d] if size[d] else 0.0, reverse=True)

    accelerator = get_accelerator()
    total, _ = reduce_over_ranks([accelerator.total_memory(), accelerator.available_memory()], "MIN", torch.int64,
                                 dist=dist, accelerator=accelerator)
    budget = _compute_persistence_budget(records, int(total), MEM_MARGIN)
    if not budget["profiled_list_count"] or not candidates or not budget["available_mem"]:
        print_rank_0(f"selective_gather: nothing to keep (budget {budget}, {len(candidates)} candidates)")
        return gm
    kept = 0
    for ds_id in candidates:
        if kept + size[ds_id] > budget["available_mem"]:
            break
        kept += size[ds_id]
        handle.set_persistent(ds_id)
    print_rank_0(f"selective_gather: {kept} bytes kept gathered of {sum(size[d] for d in candidates)} "
                 f"(budget {budget['available_mem']})")
    return gm
