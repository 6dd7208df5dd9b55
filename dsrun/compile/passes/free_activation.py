"""DeepCompile's eager freeing of activations in the backward (DeepSpeed's ``fx.add_free_activations``;
``compile.free_activation``, ``compile.free_activation_threshold``).

A compiled backward receives the forward's saved values as arguments, and autograd holds them until the whole
backward returns. With ``free_activation`` the backend puts a ``dc.free_tensors`` after the last reader of each
such value (the reloaded copy where ``offload_activation`` brought it back) of at least
``free_activation_threshold`` bytes: its storage is released there (``.data`` becomes an empty tensor), so the
rest of the backward runs without it. DeepSpeed frees values of more than 10M elements whatever the threshold
says; dsrun reads the threshold as its config documents it (bytes). It acts with the ``eager``/``aot_eager``
backends, as DeepSpeed's; inductor frees its own buffers, and ``init_z3`` refuses the key with it.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.fx import Graph, Node

from dsrun.compile.ops import GATHERS
from dsrun.compile.util import get_last_uses

_free_ops_lib = None
freed = {"tensors": 0, "bytes": 0}  # released by the op since the last reset (what a test reads)


def _free_tensors(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        if tensor.numel():
            freed["tensors"] += 1
            freed["bytes"] += tensor.numel() * tensor.element_size()
            tensor.data = torch.empty([0], device=tensor.device, dtype=tensor.dtype)


def register_free_ops() -> None:
    """``dc.free_tensors(Tensor[]) -> ()`` (DeepSpeed's op), side-effectful, once."""
    global _free_ops_lib
    if _free_ops_lib is None:
        lib = torch.library.Library("dc", "FRAGMENT")
        lib.define("free_tensors(Tensor[] tensors) -> ()")
        lib.impl("free_tensors", _free_tensors, "CompositeExplicitAutograd")
        lib.impl("free_tensors", lambda tensors: None, "Meta")
        torch.fx.node.has_side_effect(torch.ops.dc.free_tensors.default)
        _free_ops_lib = lib


def get_activation_node_names(graph: Graph) -> list[str]:
    """A backward graph's saved activations: its placeholders but the gradients of the outputs (``tangents_*``),
    the forward's own inputs (``primals_*``: the caller's tensors, or ZeRO-3 parameters) and what a gather reads."""
    return [n.name for n in graph.nodes if n.op == "placeholder" and not n.name.startswith(("tangents", "primals"))
            and not any(user.target in GATHERS for user in n.users)]


def add_free_activations(graph_id: int, graph: Graph, activation_node_names: list[str], threshold: int) -> int:
    """A ``free_tensors`` after the last reader of each named value of at least ``threshold`` bytes; returns how
    many values it frees."""
    register_free_ops()
    reloaded = {n.args[0].args[0]: n for n in graph.nodes if str(n.target) == "dc.wait_reload.default"}
    names = set(activation_node_names)
    values = {reloaded.get(n, n) for n in graph.nodes if n.op == "placeholder" and n.name in names}

    def big_enough(node: Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape) \
            and val.numel() * val.element_size() >= threshold

    node_to_last_use, _ = get_last_uses(graph)
    by_last_user: dict[Node, list[Node]] = defaultdict(list)
    for node, last_user in node_to_last_use.items():
        if node in values and big_enough(node) and last_user.op != "output":
            by_last_user[last_user].append(node)
    for last_user, used in by_last_user.items():
        with graph.inserting_after(last_user):
            graph.create_node("call_function", torch.ops.dc.free_tensors.default, (used,), {},
                              name=f"free_activations_{graph_id}")
    return sum(len(used) for used in by_last_user.values())
