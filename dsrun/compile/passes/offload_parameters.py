"""DeepCompile's parameter offload (DeepSpeed's ``passes.offload_parameters``; ``compile.offload_parameters``).

After ``zero3_compile`` has placed each gather, the pass puts, in every forward and backward graph, a
``reload_parameter`` just before the first node that reads a shard (its gather, or the prefetch that starts it) and
an ``offload_parameter`` right after the gathered value's last use (the ``release_param``): between them the shard
is on the training device, elsewhere in its host buffer (:mod:`..shard_moves` carries the moves out; the stage-3 step
and a checkpoint get every shard back first). Where several shards move as one unit (views of one fp32 master), the
unit's reload goes before the first of their readers and its offload after the last of their uses.

DeepSpeed puts the reload right after the parameter's graph input, with copies on a side stream that the gather
waits for; dsrun copies on the compute stream, so it reloads just before the reader, and a shard stays on the
device no longer than from its gather to the gathered value's last use.
"""
from __future__ import annotations

from typing import Callable

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


def _param_input(gm: GraphModule, ds_id: int) -> Node:
    return next(n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target in _SHARD_READERS
                and ds_id_of(n) == ds_id)


def add_offload_parameter(graph_id: int, gm: GraphModule, node: Node, ds_id: int,
                          param: Node | None = None) -> Node:
    """An ``offload_parameter`` of ``ds_id``'s shard right after ``node`` (the gathered value's last use; before the
    output if that is it), reading ``param``, the parameter's graph input (None: the one its gather reads)."""
    graph = gm.graph
    param = param if param is not None else _param_input(gm, ds_id)
    context = graph.inserting_before(node) if node.op == "output" else graph.inserting_after(node)
    with context:
        made = graph.create_node("call_function", OFFLOAD_PARAM, (param, graph_id, ds_id), {}, name="offload_parameter")
    made.meta["val"] = None
    return made


def add_reload_parameter(graph_id: int, gm: GraphModule, node: Node, ds_id: int, before: Node | None = None) -> Node:
    """A ``reload_parameter`` of ``ds_id``'s shard reading ``node``, the parameter's graph input: right after it
    (DeepSpeed's place), or just before ``before`` (the pass's: the shard's first reader)."""
    context = gm.graph.inserting_before(before) if before is not None else gm.graph.inserting_after(node)
    with context:
        made = gm.graph.create_node("call_function", RELOAD_PARAM, (node, graph_id, ds_id), {}, name="reload_parameter")
    made.meta["val"] = None
    return made


def offload_parameter_fwd(gm: GraphModule, graph_id: int, graph_order, profiling_results,
                          create_inputs_fn: Callable | None, mem_budget: float, param_manager,
                          bwd: bool) -> GraphModule:
    """The pass, with DeepSpeed's signature and name (it rewrites backward graphs too, as DeepSpeed's)."""
    moves = _moves()
    graph = gm.graph
    last_use, _ = get_last_uses(graph)
    position = {node: i for i, node in enumerate(graph.nodes)}
    first: dict[int, Node] = {}  # unit -> its first shard reader in this graph
    last: dict[int, tuple[Node, Node]] = {}  # unit -> (where its last gathered value dies, that gather)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SHARD_READERS:
            continue
        unit = moves.unit_of(ds_id_of(node))
        if unit is None:
            continue
        first.setdefault(unit, node)
        if node.target is not PREFETCH:  # a prefetch's token is no value: its wait's use counts
            end = last_use.get(node, node)
            if unit not in last or position[end] > position[last[unit][0]]:
                last[unit] = (end, node)
    for reader in first.values():
        add_reload_parameter(graph_id, gm, reader.args[0], ds_id_of(reader), before=reader)
    for end, gather in last.values():
        add_offload_parameter(graph_id, gm, end, ds_id_of(gather), gather.args[0])
    gm.graph.lint()
    return gm
