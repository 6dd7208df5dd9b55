"""What DeepCompile's passes ask of a graph (DeepSpeed's ``deepspeed.compile.util``): which nodes are its ops, where
each value is last used, nodes by name or tag, and AutoSP's slicing of a tagged input to this rank's part of the
sequence (:func:`shard_tensor_node`; the rest of AutoSP is :mod:`.autosp`).

A graph may hold dsrun's ops (``torch.ops.dsrun_dc``: the parameter's id is their second argument) or DeepSpeed's
(``torch.ops.dc``, where another library defined them: graph id, then parameter id); both are read alike.

A value is alive until its *last use*. An op whose output aliases an input (a view, an in-place op,
``wait_allgather`` handing on its gather) does not end the value: its own last use does
(:func:`get_no_copy_ops`, :func:`get_last_uses`, :func:`get_real_uses`).
"""
from __future__ import annotations

import functools
import operator
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from dsrun import comm
from dsrun.compile import sp_mesh
from dsrun.compile.constants import AUTOSP_INPUT_ID_KEY, AUTOSP_LABEL_ID_KEY, AUTOSP_POSITION_ID_KEY

from dsrun.compile.handle import DeepCompileHandle
from dsrun.compile.handle import get_deepcompile_handle as _handle
from dsrun.compile.ops import ALLGATHER, REDUCE, RELEASE, WAIT_ALLGATHER, define_deepspeed_ops
from dsrun.utils.logging import log_dist
from dsrun.utils.torch_version import required_torch_version

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


def reduce_over_ranks(values: list, op: str, dtype: torch.dtype = torch.float64, dist=None, accelerator=None,
                      ask_world_size: bool = True) -> list:
    """``values`` reduced over the ranks with ``ReduceOp.<op>`` (MIN, MAX, SUM): a planning pass's figures, which
    every rank must agree on or their collectives part. This rank's own without a process group or in a world of
    one. The passes run while a graph compiles, under the compiler's fake mode: the figures are made and reduced
    outside it, as real tensors on the accelerator's device (a collective dispatched through the fake mode hung
    in gloo, seen twice on a one-rank world). ``dist``/``accelerator``: the calling pass's module names (DeepSpeed's
    tests patch a pass's ``dist`` and ``get_accelerator``); dsrun's comm and accelerator by default.
    ``ask_world_size=False``: a world of one is told by the default process group itself, not by asking ``dist``
    (DeepSpeed's backend asks its ``dist`` nothing but ``is_initialized`` before its profile flag's reduce)."""
    dist = comm if dist is None else dist
    if not dist.is_initialized():
        return list(values)
    if ask_world_size:  # a stand-in without get_world_size is not asked, as DeepSpeed's passes do not ask it
        world_size = getattr(dist, "get_world_size", None)
        if world_size is not None and world_size() == 1:
            return list(values)
    elif torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1:
        return list(values)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if accelerator is None:
        from dsrun.accelerator import get_accelerator

        accelerator = get_accelerator()
    device = accelerator.current_device()
    if isinstance(device, int):  # an index (dsrun's accelerator, as DeepSpeed's): the device by name
        device = accelerator.current_device_name()
    with unset_fake_temporarily():
        figures = torch.tensor(values, dtype=dtype, device=torch.device(device))
        dist.all_reduce(figures, op=getattr(dist.ReduceOp, op))
        return figures.tolist()


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


def is_comm_op(node: Node) -> bool:
    """A node a pass marked as a collective (``node.meta["comm"]``, DeepSpeed's mark): a profiler times it between
    barriers, so that the time is the collective's and not the wait for the slowest rank."""
    return bool(node.meta.get("comm", False))


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


def find_node_by_name(gm: GraphModule, name: str) -> Node | None:
    return next((node for node in gm.graph.nodes if node.name == name), None)


def get_node_shape_meta(node: Node):
    """The fake value the tracer recorded for ``node`` (``val`` from AOT autograd, ``example_value`` from dynamo)."""
    return node.meta.get("val") or node.meta.get("example_value")


def find_node_by_tag(gm: GraphModule, tag: str) -> Node | None:
    """The first node whose traced tensor carried the attribute ``tag`` = ``tag`` (dynamo copies a tensor's
    ``__dict__`` into ``meta['tensor_dict']``): how AutoSP finds the input ids, labels and positions."""
    for node in gm.graph.nodes:
        tensor_dict = node.meta.get("tensor_dict")
        if tensor_dict and tensor_dict.get("tag") == tag:
            return node
    return None


def replace_node_users(node: Node, replacement: Node, exclude: list[Node] | None = None) -> None:
    """Every user of ``node`` but those in ``exclude`` reads ``replacement`` instead."""
    skip = set(exclude or ())
    for user in [u for u in node.users if u not in skip]:
        user.replace_input_with(node, replacement)


# --- AutoSP's graph edits (DeepSpeed keeps them here) -------------------------------------------------------------
def get_sdpa_nodes(gm: GraphModule) -> list[Node]:
    """The graph's ``F.scaled_dot_product_attention`` calls: where AutoSP puts its all-to-alls."""
    return list(gm.graph.find_nodes(op="call_function", target=F.scaled_dot_product_attention))


def _tagged(gm: GraphModule, tag: str, what: str) -> Node:
    node = find_node_by_tag(gm, tag)
    if node is None:
        raise RuntimeError(f"Failed to find a node for the {what} (a graph input whose tensor has tag={tag!r}: "
                           "prepare_autosp_inputs tags it)")
    return node


def get_input_id_node(gm: GraphModule) -> Node:
    return _tagged(gm, AUTOSP_INPUT_ID_KEY, "input sequence")


def get_label_id_node(gm: GraphModule) -> Node:
    return _tagged(gm, AUTOSP_LABEL_ID_KEY, "label")


def get_position_id_node(gm: GraphModule) -> Node | None:
    """The positions' node, or None (positions are optional)."""
    return find_node_by_tag(gm, AUTOSP_POSITION_ID_KEY)


def create_shard_offsets(gm: GraphModule, s0_node: Node) -> tuple[Node, Node]:
    """Nodes after the sequence length ``s0_node``: ``chunk = s0 // sp``, ``start = rank * chunk``,
    ``end = start + chunk`` (this rank's place in its sequence-parallel group); returns ``(start, end)``."""
    sp = sp_mesh.sp_size()
    sp_rank = comm.get_rank() % sp_mesh.sp_size()
    graph = gm.graph
    with graph.inserting_after(s0_node):
        chunk = graph.call_function(operator.floordiv, args=(s0_node, sp))
    with graph.inserting_after(chunk):
        start = graph.call_function(operator.mul, args=(sp_rank, chunk))
    with graph.inserting_after(start):
        end = graph.call_function(operator.add, args=(start, chunk))
    return start, end


def create_symbolic_slice_indices(gm: GraphModule, sym_seq_dim_node: Node) -> tuple[Node, Node]:
    """``slice(None)`` for the batch and ``slice(start, end)`` for this rank's part of the sequence."""
    start, end = create_shard_offsets(gm, sym_seq_dim_node)
    with gm.graph.inserting_after(end):
        slice_all = gm.graph.call_function(slice, args=(None, None, None))
    with gm.graph.inserting_after(slice_all):
        slice_range = gm.graph.call_function(slice, args=(start, end, None))
    return slice_all, slice_range


def shard_tensor_node(gm: GraphModule, tensor_node: Node) -> Node:
    """Every reader of ``tensor_node`` (``[batch, sequence, ...]``, its sequence length symbolic) reads this rank's
    slice of the sequence instead; returns the slice's node."""
    value = get_node_shape_meta(tensor_node)
    if value is None:
        raise ValueError(f"node {tensor_node.name} has no shape metadata")
    seq_len = value.shape[1]
    if not isinstance(seq_len, torch.SymInt):
        raise ValueError(f"{tensor_node.name}'s sequence dimension is {seq_len!r}, not symbolic: mark it dynamic "
                         "(prepare_autosp_inputs) or compile with dynamic=True")
    seq_node = find_node_by_name(gm, str(seq_len))
    if seq_node is None:
        raise ValueError(f"no graph node holds {tensor_node.name}'s sequence length {seq_len}")
    slice_all, slice_range = create_symbolic_slice_indices(gm, seq_node)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    # after both the tensor and the slice (the length's placeholder may come after the tensor's)
    anchor = slice_range if position[slice_range] > position[tensor_node] else tensor_node
    with gm.graph.inserting_after(anchor):
        sliced = gm.graph.call_function(operator.getitem, args=(tensor_node, (slice_all, slice_range)))
    replace_node_users(tensor_node, sliced, exclude=[sliced])
    return sliced
