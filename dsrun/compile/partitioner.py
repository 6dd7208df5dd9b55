"""What the joint graph is told before AOT autograd's partitioner cuts it (DeepSpeed's
``deepspeed.compile.partitioner``): at ZeRO-3 the backward must compute again every full parameter value it reads
rather than keep the forward's alive (between the two only shards live).

:func:`_recompute_param_aliases` marks ``MUST_RECOMPUTE`` the gathers (dsrun's ``allgather_param``/
``wait_allgather``, whose value is the full parameter), the parameter inputs themselves, and every node that
aliases or casts one of those, transitively: a view (``t``, ``view``, ``permute`` ... any op whose result aliases
an input, :func:`get_no_copy_ops`) or a dtype cast (autocast's downcast, :func:`is_cast_op`) would otherwise be
saved for the backward and hold the whole parameter's memory. Other nodes keep the min-cut partitioner's own
choice (a policy already set on them is left alone). :func:`get_wrapped_partitioner` runs it before the
partitioner and records the frame that was cut and the forward's output count.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from dsrun.compile.ops import GATHERS
from dsrun.compile.util import get_no_copy_ops

_num_fwd_outputs_by_frame: dict[int, int] = {}  # frame -> how many forward outputs the caller receives


def is_cast_op(node: Node) -> tuple[bool, torch.dtype | None]:
    """Whether ``node`` only changes its input's dtype, and to which."""
    if node.op == "call_function":
        if node.target == torch.ops.prims.convert_element_type.default:
            return True, node.args[1]
        if node.target == torch.ops.aten._to_copy.default and set(node.kwargs) == {"dtype"}:
            return True, node.kwargs["dtype"]
    return False, None


def _recompute_param_aliases(joint_graph: Graph, param_indices: Sequence[tuple[int, int, Any]]) -> None:
    """Mark the full parameter values of ``joint_graph`` and their aliases and casts ``MUST_RECOMPUTE``;
    ``param_indices``: ``(input index, ds_id, shape)`` of the parameter inputs. Every node gets an
    ``ac_graph_id`` (1 where none), which the min-cut partitioner reads for each node it is told to recompute."""
    from torch._functorch.partitioners import _is_primal

    no_copy_ops = get_no_copy_ops()
    primals = [n for n in joint_graph.nodes if _is_primal(n)]
    seeds = {primals[i] for i, _, _ in param_indices if i < len(primals)}
    recomputed: set[Node] = set()
    for node in joint_graph.nodes:
        node.meta.setdefault("ac_graph_id", 1)
        if node.op != "call_function":
            continue
        if node.target in GATHERS:
            full_value = True
        else:  # arguments may be unhashable non-tensors: test membership on nodes only
            reads_full = any(isinstance(a, Node) and (a in seeds or a in recomputed) for a in node.args)
            full_value = reads_full and (node.target in no_copy_ops or is_cast_op(node)[0])
        if full_value:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            recomputed.add(node)


def get_num_fwd_outputs(frame_id: int) -> int | None:
    """How many of frame ``frame_id``'s forward outputs its caller receives (the rest are saved for backward)."""
    return _num_fwd_outputs_by_frame.get(frame_id)


def get_wrapped_partitioner(z3_partition: bool, param_indices: Sequence[tuple[int, int, Any]],
                            partition_fn: Callable, frame_id: int, frames_partitioned: set[int]) -> Callable:
    """``partition_fn`` after :func:`_recompute_param_aliases` (``z3_partition``); the frame is recorded in
    ``frames_partitioned`` (a backward will follow) with its forward's output count."""

    def partition(joint_module: GraphModule, joint_inputs: Sequence[Any], **kwargs: object) -> Any:
        frames_partitioned.add(frame_id)
        if "num_fwd_outputs" in kwargs:
            _num_fwd_outputs_by_frame[frame_id] = kwargs["num_fwd_outputs"]
        if z3_partition:
            _recompute_param_aliases(joint_module.graph, param_indices)
        return partition_fn(joint_module, joint_inputs, **kwargs)

    return partition
