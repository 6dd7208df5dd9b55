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


# what a profiled node carries (DeepSpeed's keys): bytes of its output, resident and peak bytes after it, its
# time. dsrun's profile is from shapes and times nothing: the times are 0 (the list scheduler then orders by memory)
PROFILE_META_DEFAULTS = {"device_time": 0.0, "wall_time": 0.0, "tensor_size": 0, "alloc_mem": 0, "max_mem": 0}
INCOMPLETE = "profile_incomplete"


def annotate(graph: Graph, records: list[tuple[str, int, int, int]]) -> None:
    """Each node's profile keys from its :func:`memory_records` row; a node without a row is left without them
    (and the graph is then incomplete: :func:`_backfill_missing_profile_metadata`)."""
    by_name = {name: (resident, peak) for name, resident, _, peak in records}
    for node in graph.nodes:
        if node.name in by_name:
            node.meta["tensor_size"] = 0 if _is_view(node) else tensor_bytes(node)
            node.meta["alloc_mem"], node.meta["max_mem"] = by_name[node.name]
            node.meta.setdefault("device_time", 0.0)
            node.meta.setdefault("wall_time", 0.0)
    _backfill_missing_profile_metadata(graph, profile_complete=len(by_name) == len(graph.nodes))


def _backfill_missing_profile_metadata(graph: Graph, profile_complete: bool = True) -> None:
    """A profile that missed nodes (or ``profile_complete`` False) marks every node of the graph incomplete, then
    gives each missing key its default, so the planning passes can read any node and skip the graph."""
    if not profile_complete or any(key not in n.meta for n in graph.nodes for key in PROFILE_META_DEFAULTS):
        for node in graph.nodes:
            node.meta[INCOMPLETE] = True
    for node in graph.nodes:
        for key, default in PROFILE_META_DEFAULTS.items():
            node.meta.setdefault(key, default)


def is_profile_incomplete(graph: Graph | None) -> bool:
    """A graph some of whose nodes the profile did not reach (their ``meta["profile_incomplete"]``)."""
    return graph is not None and any(getattr(n, "meta", {}).get(INCOMPLETE) for n in graph.nodes)
