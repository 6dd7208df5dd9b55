"""A graph's memory, from the shapes the compiler already knows (DeepSpeed measures it by running the graph on
the device; on dsrun's host graphs the tensor sizes in ``node.meta["val"]`` give the same accounting, with no
extra run): each node's output is allocated when it runs and freed after its last reader; a view allocates
nothing. Gathered parameters are counted at full size, which is what the selective-gather budget needs."""
from __future__ import annotations

from typing import Any

from torch.fx import Graph

from dsrun.compile.passes.graph_edit import _is_view, tensor_bytes


def memory_records(graph: Graph) -> list[tuple[str, int, int, int]]:
    """``(node name, resident bytes after the node, change, peak while it ran)`` for every node in order."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    frees: dict[int, list[Any]] = {}
    for node in graph.nodes:
        readers = [position[u] for u in node.users if u.op != "output"]
        if readers and not _is_view(node) and not any(u.op == "output" for u in node.users):
            frees.setdefault(max(readers), []).append(node)
    resident, records = 0, []
    for i, node in enumerate(graph.nodes):
        before = resident
        if not _is_view(node) and node.op in ("call_function", "call_module", "call_method"):
            resident += tensor_bytes(node)
        peak = resident
        for freed in frees.get(i, []):
            if freed.op != "placeholder":
                resident -= tensor_bytes(freed)
        records.append((node.name, resident, resident - before, peak))
    return records


def is_profile_incomplete(graph: Graph | None) -> bool:
    """A graph some of whose nodes the profile did not reach (their ``meta["profile_incomplete"]``)."""
    return graph is not None and any(getattr(n, "meta", {}).get("profile_incomplete") for n in graph.nodes)
