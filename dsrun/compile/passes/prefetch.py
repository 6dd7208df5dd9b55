"""Prefetch (DeepSpeed's ``prefetch``): start each parameter's all-gather while earlier nodes still compute.

For every ``allgather_param`` (placed by :mod:`.zero3_compile`) a ``prefetch_param`` is inserted where the
gathers issued ahead of it still fit in ``stage3_prefetch_bucket_size`` elements (at least one gather ahead:
the next parameter's collective overlaps the current one's compute), and its token is handed to the gather, so
no compiler can run the gather before its prefetch (``wait_allgather`` takes the gather's place). The collective runs asynchronously on the data-parallel
group; the gather waits for it.
"""
from __future__ import annotations

from torch.fx import GraphModule

from dsrun.compile.handle import get_deepcompile_handle
from dsrun.compile.util import print_rank_0
from dsrun.compile.ops import ALLGATHER, PREFETCH, WAIT_ALLGATHER
from dsrun.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract
from dsrun.compile.passes.graph_edit import nodes_of
from dsrun.compile.profilers.graph_profile import is_profile_incomplete

NAME = "prefetch"
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))
DEFAULT_BUCKET_NUMEL = 50_000_000  # stage3_prefetch_bucket_size's default
bucket_numel = [DEFAULT_BUCKET_NUMEL]  # set from the config by the backend


def insert_prefetches(gm: GraphModule, budget: int) -> int:
    """Returns how many gathers got a prefetch."""
    graph = gm.graph
    handle = get_deepcompile_handle()
    gathers = nodes_of(graph, ALLGATHER)
    done = 0
    for k, gather in enumerate(gathers):
        if k == 0:
            continue
        # walk back over the gathers before this one while what is in flight fits the budget
        start, ahead = k - 1, handle.params[gather.args[1]].ds_numel
        while start > 0 and ahead + handle.params[gathers[start - 1].args[1]].ds_numel <= budget:
            start -= 1
            ahead += handle.params[gathers[start].args[1]].ds_numel
        anchor = gathers[start]
        with graph.inserting_before(anchor):
            token = graph.call_function(PREFETCH, (gather.args[0], gather.args[1]))
        placeholder_value = gather.args[0].meta.get("val")
        if placeholder_value is not None:  # the compiler lowers from these fake values
            token.meta["val"] = placeholder_value.new_empty(0)
        with graph.inserting_before(gather):
            wait = graph.call_function(WAIT_ALLGATHER, (gather.args[0], gather.args[1], token))
        wait.meta["val"] = gather.meta.get("val")  # not the gather's recorded eager inputs: its schema differs
        gather.replace_all_uses_with(wait)
        graph.erase_node(gather)
        done += 1
    return done


def schedule_prefetch(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                      mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    """The pass; a graph whose profile is incomplete (DeepSpeed's rule: on any rank) is left as it is."""
    profile = profiling_results.get(graph_id)
    if profile is not None:
        graph = profile.bwd_graph if bwd else profile.fwd_graph
        complete = profile.bwd_mem_complete if bwd else profile.fwd_mem_complete
        if is_profile_incomplete(graph) or not complete:
            print_rank_0(f"schedule_prefetch graph_id={graph_id} incomplete profiling data; skipping prefetch")
            return gm
    insert_prefetches(gm, bucket_numel[0])
    gm.graph.lint()
    gm.recompile()
    return gm
