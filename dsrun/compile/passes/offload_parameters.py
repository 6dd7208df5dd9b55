"""DeepCompile's parameter offload (DeepSpeed's ``passes.offload_parameters``; ``compile.offload_parameters``).

After ``zero3_compile`` has placed each gather, the pass puts, in every forward and backward graph, a
``reload_parameter`` just before the first node that reads a shard (its gather, or the prefetch that starts it) and
an ``offload_parameter`` right after the gathered value's last use (the ``release_param``): between them the shard
is on the training device, elsewhere in its host buffer (:mod:`..shard_moves` carries the moves out; the stage-3 step
gets the masters back first). The gather reads the reload's output (a token) in place of the parameter's input, and
the offload reads the gathered value: under inductor, which may reorder nodes that do not depend on each other,
the reload still comes before the gather and the offload after it. Where several shards move as one unit (views of
one fp32 master), the unit comes back at the first of their reloads and leaves after the last of their uses.

DeepSpeed puts the reload right after the parameter's graph input, with copies on a side stream that the gather
waits for; dsrun copies on the compute stream, so it reloads just before the reader, and a shard stays on the
device no longer than from its gather to the gathered value's last use.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import GraphModule, Node

from dsrun.compile.handle import get_deepcompile_handle
from dsrun.compile.ops import ALLGATHER, OFFLOAD_PARAM, PREFETCH, RELOAD_PARAM, WAIT_ALLGATHER
from dsrun.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract
from dsrun.compile.shard_moves import ShardMoves
from dsrun.compile.util import ds_id_of, get_last_uses

NAME = "offload_parameters"
# rewrites the gathers zero3_compile places, so it runs after that pass (DeepSpeed's contract)
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))

_SHARD_READERS = (ALLGATHER, WAIT_ALLGATHER, PREFETCH)


def _moves() -> ShardMoves:
    """The handle's moves (``init_z3`` makes them from the strategy); a graph compiled without an engine moves
    each registered parameter's shard alone."""
    handle = get_deepcompile_handle()
    if handle.param_moves is None:
        handle.param_moves = ShardMoves.for_params(handle.params.values())
    return handle.param_moves


def get_ds_id(node: Node) -> int:
    """The parameter id of a gather node (DeepSpeed's helper)."""
    assert node.op == "call_function" and node.target in (ALLGATHER, WAIT_ALLGATHER), node
    return ds_id_of(node)


def _last_gather(gm: GraphModule, ds_id: int) -> Node:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (ALLGATHER, WAIT_ALLGATHER)
            and ds_id_of(n) == ds_id][-1]


def add_offload_parameter(graph_id: int, gm: GraphModule, node: Node, ds_id: int, full: Node | None = None) -> Node:
    """An ``offload_parameter`` of ``ds_id``'s shard right after ``node`` (the gathered value's last use; before the
    output if that is it), reading ``full``, the gathered value (None: the graph's last gather of ``ds_id``), so that
    it runs after the gather under any compiler."""
    graph = gm.graph
    full = full if full is not None else _last_gather(gm, ds_id)
    context = graph.inserting_before(node) if node.op == "output" else graph.inserting_after(node)
    with context:
        made = graph.create_node("call_function", OFFLOAD_PARAM, (full, graph_id, ds_id), {}, name="offload_parameter")
    made.meta["val"] = None
    return made


def _computed_before(node: Node) -> list[Node]:
    """The nearest tensor computed before ``node`` in the graph's order (none: ``node`` comes first)."""
    at = node.prev
    while at.op not in ("root", "placeholder"):
        if at.op == "call_function" and isinstance(at.meta.get("val"), torch.Tensor):
            return [at]
        at = at.prev
    return []


def add_reload_parameter(graph_id: int, gm: GraphModule, node: Node, ds_id: int, before: Node | None = None) -> Node:
    """A ``reload_parameter`` of ``ds_id``'s shard reading ``node``, the parameter's graph input: right after it
    (DeepSpeed's place), or just before ``before`` (the pass's: the shard's first reader; the reload then also reads
    the tensor computed just before, so that inductor cannot hoist it). Its output is a token for the gather to read
    in place of ``node``."""
    after = _computed_before(before) if before is not None else []
    context = gm.graph.inserting_before(before) if before is not None else gm.graph.inserting_after(node)
    with context:
        made = gm.graph.create_node("call_function", RELOAD_PARAM, (node, after, graph_id, ds_id), {},
                                    name="reload_parameter")
    value = node.meta.get("val")
    made.meta["val"] = value.new_empty(0) if isinstance(value, torch.Tensor) else None
    return made


def offload_parameter_fwd(gm: GraphModule, graph_id: int, graph_order, profiling_results,
                          create_inputs_fn: Callable | None, mem_budget: float, param_manager,
                          bwd: bool) -> GraphModule:
    """The pass, with DeepSpeed's signature and name (it rewrites backward graphs too, as DeepSpeed's)."""
    moves = _moves()
    graph = gm.graph
    last_use, _ = get_last_uses(graph)
    position = {node: i for i, node in enumerate(graph.nodes)}
    first: dict[Node, Node] = {}  # parameter input -> its first shard reader in this graph
    last: dict[int, tuple[Node, Node]] = {}  # unit -> (where its last gathered value dies, that gather)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SHARD_READERS:
            continue
        unit = moves.unit_of(ds_id_of(node))
        if unit is None:
            continue
        first.setdefault(node.args[0], node)
        if node.target is not PREFETCH:  # a prefetch's token is no value: its wait's use counts
            end = last_use.get(node, node)
            if unit not in last or position[end] > position[last[unit][0]]:
                last[unit] = (end, node)
    for param, reader in first.items():  # one per parameter (a unit's first brings it back, the rest find it)
        token = add_reload_parameter(graph_id, gm, param, ds_id_of(reader), before=reader)
        for user in [u for u in param.users if u.op == "call_function" and u.target in _SHARD_READERS]:
            user.replace_input_with(param, token)
    for end, gather in last.values():
        add_offload_parameter(graph_id, gm, end, ds_id_of(gather), gather)
    gm.graph.lint()
    return gm
