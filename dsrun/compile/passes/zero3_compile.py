"""ZeRO-3 in the graph (DeepSpeed's ``zero3_compile``): each parameter gathered just before its first reader,
released after its last, each gradient reduced as soon as the backward has computed it.

The compiled forward (:mod:`..backend`) reads every parameter through ``allgather_param``, whose gradient is
``reduce_grad``; dynamo and AOT autograd trace them where the forward asked, all gathers first. This pass, on the
partitioned forward and backward graphs (the backward gathers again: :func:`..partitioner._recompute_param_aliases`):

* moves each ``allgather_param`` to just before the first node that reads it;
* inserts ``release_param`` after the last node that reads the gathered value or a view of it (the memory goes
  with the graph's last reference there; the handle counts what is live);
* moves each ``reduce_grad`` to just after the node that produced its gradient, so the reduce-scatter buckets
  fill during the backward instead of at its end, and ends the backward with ``end_backward`` after all of them
  (:func:`..fx.add_end_backward`): the step's last backward graph launches the buckets still pending.

Then the list scheduler (:mod:`..list_schedule`, as DeepSpeed's pass) reorders the graph so that each gathered
parameter is released as soon after its gather as the graph allows.

Without it the whole model is gathered at the top of each graph: correct, but no ZeRO-3 memory saving.
"""
from __future__ import annotations

from torch.fx import GraphModule

from dsrun.compile.fx import add_end_backward, should_release_reduce_buckets
from dsrun.compile.list_schedule import fast_free_order, reorder_in_place
from dsrun.compile.ops import ALLGATHER, REDUCE, RELEASE, WAIT_ALLGATHER
from dsrun.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract
from dsrun.compile.passes.graph_edit import aliases, first_reader, last_reader, nodes_of, returns_output

NAME = "zero3_compile"
CONTRACT = PassContract(provides=frozenset({CAP_Z3_GATHER_RELEASE}))


def place_gathers_and_releases(gm: GraphModule) -> int:
    """Gathers before first use, releases after last use; returns the releases inserted."""
    graph = gm.graph
    for gather in nodes_of(graph, ALLGATHER):
        reader = first_reader(graph, gather)
        if reader is not None and reader.op != "output":
            reader.prepend(gather)
    inserted = 0
    for gather in nodes_of(graph, ALLGATHER) + nodes_of(graph, WAIT_ALLGATHER):
        views = aliases(gather)
        if any(returns_output(v) for v in views) or any(u.target is RELEASE for u in gather.users):
            continue  # the value leaves the graph (or was released already): its owner frees it
        last = last_reader(graph, views)
        if last is None:
            continue
        with graph.inserting_after(last):
            graph.call_function(RELEASE, (gather, gather.args[1])).meta["val"] = None
        inserted += 1
    return inserted


def reduce_early(gm: GraphModule) -> None:
    for reduce in nodes_of(gm.graph, REDUCE):
        producer = reduce.args[0]
        if producer.op != "placeholder":
            producer.append(reduce)


def add_z3_gather_release(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                          mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    """The pass, with DeepSpeed's signature (of the arguments after ``gm``, ``graph_id``, ``graph_order`` and
    ``bwd`` are read)."""
    place_gathers_and_releases(gm)
    if bwd:
        reduce_early(gm)
        add_end_backward(gm.graph, graph_id, should_release_reduce_buckets(graph_order, graph_id))
    reorder_in_place(gm.graph, fast_free_order(gm.graph))
    gm.recompile()
    return gm
