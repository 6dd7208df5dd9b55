"""AutoSP's graph edits (DeepSpeed's ``deepspeed.compile.constants``, AutoSP's part of ``deepspeed.compile.util``
and ``passes.sp_compile.prepare_autosp_inputs``): sequence parallelism written into a dynamo graph.

The inputs are found by their tag: :func:`prepare_autosp_inputs` sets ``tensor.tag`` on the input ids, labels
and positions (dynamo copies a tensor's attributes into its placeholder's ``meta['tensor_dict']``) and marks
their sequence dimension dynamic, so the graph holds that length as a symbol (a SymInt placeholder named for it).
:func:`shard_tensor_node` then makes every reader of such an input read this rank's slice of the sequence:
``x[:, start:end]`` with ``chunk = s // sp_size``, ``start = sp_rank * chunk``, ``end = start + chunk``
(:func:`create_shard_offsets`; ``sp_size`` and the rank are read from :mod:`.sp_mesh` and :mod:`dsrun.comm` when
the edit is made, and baked into the graph).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from dsrun import comm
from dsrun.compile import sp_mesh
from dsrun.compile.fx import find_node_by_name, find_node_by_tag, get_node_shape_meta, replace_node_users

AUTOSP_INPUT_ID_KEY = "input_id"
AUTOSP_LABEL_ID_KEY = "label_id"
AUTOSP_POSITION_ID_KEY = "position_id"


def prepare_autosp_inputs(input_id: torch.Tensor, label_id: torch.Tensor, position_id: torch.Tensor | None = None,
                          attention_mask: torch.Tensor | None = None, seq_dim: int = 1) -> tuple:
    """Tag the input ids, labels (and positions) for AutoSP and mark ``seq_dim`` of each given tensor dynamic;
    returns them as given."""
    if input_id is None:
        raise ValueError("input_id is required")
    if label_id is None:
        raise ValueError("label_id is required")
    if not 0 <= seq_dim < input_id.ndim:
        raise ValueError(f"seq_dim {seq_dim} must be a valid index for input_id with shape {tuple(input_id.shape)}")
    for name, tensor in (("position_id", position_id), ("attention_mask", attention_mask)):
        if tensor is not None and seq_dim >= tensor.ndim:
            raise ValueError(f"seq_dim {seq_dim} is out of bounds for {name} with shape {tuple(tensor.shape)}")
    for tensor in (input_id, label_id, position_id, attention_mask):
        if tensor is not None:
            torch._dynamo.decorators.mark_dynamic(tensor, seq_dim)
    input_id.tag = AUTOSP_INPUT_ID_KEY
    label_id.tag = AUTOSP_LABEL_ID_KEY
    if position_id is not None:
        position_id.tag = AUTOSP_POSITION_ID_KEY
    return input_id, label_id, position_id, attention_mask


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
