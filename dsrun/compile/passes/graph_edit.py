"""Small FX edits the passes share: finding DeepCompile's ops, moving nodes, the last reader of a value."""
from __future__ import annotations

from typing import Iterable

import torch
from torch.fx import Graph, Node


def nodes_of(graph: Graph, target: object) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def is_backward(graph: Graph) -> bool:
    """The backward graph of a partitioned joint graph takes the output gradients (``tangents_*``)."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def _is_view(node: Node) -> bool:
    """``node`` returns a view of (some) input: aten view ops, and ``getitem`` of a multi-output op."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def aliases(node: Node) -> list[Node]:
    """``node`` and every view taken of it, transitively."""
    found, todo = [node], [node]
    while todo:
        for user in todo.pop().users:
            if _is_view(user) and user not in found:
                found.append(user)
                todo.append(user)
    return found


def last_reader(graph: Graph, values: Iterable[Node]) -> Node | None:
    """The last node in graph order that reads any of ``values`` (None: only the output reads them)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for v in values for u in v.users if u.op != "output"]
    return max(readers, key=position.__getitem__, default=None)


def first_reader(graph: Graph, node: Node) -> Node | None:
    position = {n: i for i, n in enumerate(graph.nodes)}
    return min(node.users, key=position.__getitem__, default=None)


def returns_output(node: Node) -> bool:
    return any(u.op == "output" for u in node.users)


def tensor_bytes(node: Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return 0
