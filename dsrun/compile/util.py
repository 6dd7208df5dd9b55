"""What DeepCompile's passes ask of a graph (DeepSpeed's ``deepspeed.compile.util``): which nodes are its ops, and
where each value is last used.

A graph may hold dsrun's ops (``torch.ops.dsrun_dc``: the parameter's id is their second argument) or DeepSpeed's
(``torch.ops.dc``, where another library defined them: graph id, then parameter id); both are read alike.

A value is alive until its *last use*. An op whose output aliases an input (a view, an in-place op,
``wait_allgather`` handing on its gather) does not end the value: its own last use does
(:func:`get_no_copy_ops`, :func:`get_last_uses`, :func:`get_real_uses`).
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from dsrun.compile.handle import DeepCompileHandle
from dsrun.compile.handle import get_deepcompile_handle as _handle
from dsrun.compile.ops import ALLGATHER, REDUCE, RELEASE, WAIT_ALLGATHER, define_deepspeed_ops
from dsrun.utils.logging import log_dist
from dsrun.utils.torch_version import required_torch_version

# AutoSP's graph edits, which DeepSpeed keeps in this module: dsrun's are in dsrun.compile.autosp
_AUTOSP_NAMES = frozenset({"get_sdpa_nodes", "get_input_id_node", "get_label_id_node", "get_position_id_node",
                           "create_shard_offsets", "create_symbolic_slice_indices", "shard_tensor_node"})


def __getattr__(name: str) -> object:
    if name in _AUTOSP_NAMES:
        from dsrun.compile import autosp
        return getattr(autosp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_deepcompile_supported() -> bool:
    """Whether DeepCompile runs here: torch 2.6 or later (DeepSpeed's bound). dsrun's ops are Python over its own
    ZeRO-3, so unlike DeepSpeed's CUDA library they run on a CPU too."""
    return required_torch_version(min_version=2.6)


def get_deepcompile_handle() -> DeepCompileHandle:
    """The process's DeepCompile handle; as DeepSpeed's (which loads its C++ ops here), DeepSpeed's
    ``torch.ops.dc.reduce_grad`` and ``dc.end_backward`` exist after it (:func:`.ops.define_deepspeed_ops`)."""
    define_deepspeed_ops()
    return _handle()


def print_rank_0(message: str) -> None:
    """A pass's log line, on rank 0 (DeepSpeed's passes print theirs)."""
    log_dist(message, ranks=[0])


def _deepspeed_op(name: str) -> object | None:
    """DeepSpeed's ``torch.ops.dc.<name>.default`` where some library defined it, else None."""
    try:
        return getattr(getattr(torch.ops.dc, name), "default")
    except (AttributeError, RuntimeError):
        return None


def _is_op(node: Node, dsrun_op: object, name: str) -> bool:
    """``node`` calls dsrun's op, or DeepSpeed's ``dc.<name>`` (told by its name: no lookup per node)."""
    return node.op == "call_function" and (node.target is dsrun_op or str(node.target) == f"dc.{name}.default")


def is_allgather_node(node: Node) -> bool:
    return _is_op(node, ALLGATHER, "allgather_param")


def is_release_node(node: Node) -> bool:
    return _is_op(node, RELEASE, "release_param")


def is_reduce_node(node: Node) -> bool:
    return _is_op(node, REDUCE, "reduce_grad")


def ds_id_of(node: Node) -> int:
    """The parameter id a gather, wait, release or reduce node names."""
    return node.args[1] if str(node.target).startswith("dsrun_dc.") else node.args[2]


@functools.lru_cache
def get_no_copy_ops() -> frozenset:
    """The ops whose output may alias an input: the waits for a gather, and every aten overload whose schema
    returns an aliased tensor (views and in-place ops; conservative where only some inputs are aliased)."""
    ops = {op for op in (WAIT_ALLGATHER, _deepspeed_op("wait_allgather")) if op is not None}
    for name in torch.ops.aten:
        packet = getattr(torch.ops.aten, name)
        for overload in packet:
            op = getattr(packet, overload)
            schema = getattr(op, "_schema", None)
            if schema is None or any(isinstance(r.type, torch.TensorType) and r.alias_info is not None
                                     for r in schema.returns):
                ops.add(op)  # no schema: it may alias, assume it does
    return frozenset(ops)  # cached: never handed out mutable


def get_last_uses(graph: Graph) -> tuple[dict[Node, Node], dict[Node, list[Node]]]:
    """``node -> the node after which its value is dead`` and the inverse, ``node -> values dead after it``.

    Walked from the end: a value's last use is its last reader, except that a reader whose output aliases it
    (:func:`get_no_copy_ops`) hands on its own last use, when that comes later."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    no_copy = get_no_copy_ops()
    last_use: dict[Node, Node] = {}
    dead_after: dict[Node, list[Node]] = {}

    def record(value: Node, reader: Node) -> None:
        aliasing = reader.target in no_copy
        candidate = last_use.get(reader, reader) if aliasing else reader
        known = last_use.get(value)
        if known is not None and not (aliasing and position[candidate] > position[known]):
            return
        if known is not None:
            dead_after[known].remove(value)
        last_use[value] = candidate
        dead_after.setdefault(candidate, []).append(value)

    for node in reversed(graph.nodes):
        map_arg(node.args, lambda value: record(value, node))
        map_arg(node.kwargs, lambda value: record(value, node))
    return last_use, dead_after


def get_real_uses(graph: Graph) -> dict[Node, list[Node]]:
    """``node -> the nodes that read its value``, through aliasing readers to their own readers (the graph's
    output is no use)."""
    no_copy = get_no_copy_ops()
    uses: dict[Node, list[Node]] = defaultdict(list)

    def record(value: Node, reader: Node) -> None:
        if reader.op == "output":
            return
        if reader.target in no_copy:
            uses[value].extend(uses[reader])
        else:
            uses[value].append(reader)

    for node in reversed(graph.nodes):
        map_arg(node.args, lambda value: record(value, node))
        map_arg(node.kwargs, lambda value: record(value, node))
    return uses


def get_output_node(graph: Graph) -> Node:
    """The graph's output node (``ValueError`` when it has none)."""
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise ValueError("No output node found")
