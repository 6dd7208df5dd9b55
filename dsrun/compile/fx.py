"""FX graph edits DeepCompile's passes share (DeepSpeed's ``deepspeed.compile.fx``): the end of a backward; finding
nodes (the output, by name, by a tensor's tag) and rewiring users, which live in :mod:`.util` and are named here
as DeepSpeed's module has them.

``add_end_backward`` puts an ``end_backward`` op before a backward graph's output that reads every gradient
reduction of the graph, so it runs after all of them: with ``release_reduce_buckets`` (the last backward graph
to run, :func:`should_release_reduce_buckets`) it launches the reduce-scatter buckets still pending
(:meth:`.handle.DeepCompileHandle.end_backward`). It works on dsrun's ops (``torch.ops.dsrun_dc``) and on
DeepSpeed's (``torch.ops.dc``), each graph with its own library's ``end_backward``.
"""
from __future__ import annotations

from torch.fx import Graph, Node
from torch.fx.node import map_aggregate

from dsrun.compile.ops import END_BACKWARD
from dsrun.compile.util import (_deepspeed_op, find_node_by_name, find_node_by_tag, get_node_shape_meta,
                                get_output_node, is_reduce_node, replace_node_users)

__all__ = ["get_output_node", "should_release_reduce_buckets", "add_end_backward", "replace_reduce_outputs_with_none",
           "find_node_by_name", "get_node_shape_meta", "find_node_by_tag", "replace_node_users"]


def should_release_reduce_buckets(graph_order: list[tuple[int, bool]], graph_id: int) -> bool:
    """Whether ``graph_id``'s backward is the last to run in a step: the backward graphs run in the reverse order
    of their forwards, so the last is the first forward's that needs one (with none, every graph releases)."""
    backward_ids = [gid for gid, needs_backward in graph_order if needs_backward]
    return not backward_ids or graph_id == backward_ids[0]


def add_end_backward(graph: Graph, graph_id: int, release_reduce_buckets: bool = True) -> Node | None:
    """An ``end_backward(reduces, graph_id, release_reduce_buckets)`` before the output, after every reduction of
    ``graph`` (it reads them all); None, and the graph unchanged, when the graph reduces nothing."""
    reduces = [n for n in graph.nodes if is_reduce_node(n)]
    if not reduces:
        return None
    deepspeeds = str(reduces[0].target).startswith("dc.")
    op = _deepspeed_op("end_backward") if deepspeeds else END_BACKWARD
    if op is None:
        raise RuntimeError("the graph reduces with DeepSpeed's torch.ops.dc.reduce_grad but no library defines "
                           "dc.end_backward: call deepspeed.compile.util.get_deepcompile_handle() first")
    with graph.inserting_before(get_output_node(graph)):
        return graph.call_function(op, (reduces, graph_id, release_reduce_buckets))


def replace_reduce_outputs_with_none(graph: Graph) -> None:
    """A reduction's value never leaves the graph: where the output names one, it returns None there."""
    output = get_output_node(graph)
    output.args = (map_aggregate(output.args[0], lambda v: None if isinstance(v, Node) and is_reduce_node(v) else v),)
