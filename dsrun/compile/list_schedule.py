"""The list scheduler of ZeRO-3's graphs (DeepSpeed's ``deepspeed.compile.list_schedule``): order a graph's nodes
so that each gathered parameter is freed as soon after its gather as the graph allows.

:func:`fast_free_schedule` places the gathers one at a time. For each gather not yet placed it works out what
placing it would take: the nodes it needs first (``schedule_until_ag``), and the nodes up to its last use and its
releases (``schedule_until_free``). A gather that needs no other gather before its release (``free_acc_mem`` of 0)
is preferred, with everything up to its release placed at once; among those, the one whose path holds the fewest
gathers, then the fewest gathered bytes, then the least device time. Otherwise only the nodes up to the gather
are placed, the gather with the fewest gathered bytes before its release first. Candidates come from the gathers
with the fewest other gathers still ahead of their last use. A reduce, or an output, is placed as soon as the
gathers it needs are, a release as soon as the last reader of its value is. The rest keeps its order.

dsrun's one departure, in that fallback: when the chosen gather's path to its release needs a gather that is no
candidate (its own last use needs more gathers: a value read again much later, as a token embedding tied to the
output head), that gather is placed first, up to itself, and the choice is made again; its path is then free.
DeepSpeed's rule placed the chosen gather alone, and since the long-lived gather never becomes a candidate before
the end, every other gather in turn: the whole model gathered at the forward's start (docs/deepcompile.md, "The
list scheduler and tied embeddings"). The long-lived value is gathered there either way (the candidate's release
needs it), and stays gathered to its last reader either way; where every blocker is a candidate, DeepSpeed's rule
is kept as it is.

Node costs are ``meta["tensor_size"]`` (bytes; 0 where the profile did not reach) and ``meta["device_time"]``
(dsrun's profile is from shapes and times nothing: 0, the order is then by memory alone).

A release in dsrun's graphs reads the gathered value itself (not its last reader, as DeepSpeed's), so it is
made to wait for every reader of that value (:func:`_inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node
from torch.fx.node import map_arg

from dsrun.compile import util
from dsrun.compile.ops import RELEASE


def _inputs(node: Node, real_uses: dict[Node, list[Node]]) -> list[Node]:
    """The nodes ``node`` must come after: its arguments, and for dsrun's release every reader of the value."""
    found: list[Node] = []
    map_arg((node.args, node.kwargs), found.append)
    if node.target is RELEASE and found:
        found += [u for u in real_uses[found[0]] if u is not node]
    return found


def _requirements(target: Node, placed: set[Node], real_uses: dict[Node, list[Node]]) -> list[Node]:
    """The nodes not in ``placed`` that ``target`` needs, ``target`` last, each after what it needs."""
    ordered: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(target, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            ordered.append(node)
            continue
        if node in placed or node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((arg, False) for arg in reversed(_inputs(node, real_uses)))
    return ordered


@dataclass
class AllgatherTask:
    node: Node
    allgather_cost: float
    free_cost: float
    allgathered_mem: int
    allgather_acc_mem: int
    free_acc_mem: int
    last_use: Node
    n_scheduled_ags: int
    schedule_until_ag: list[Node]
    schedule_until_free: list[Node]


def _free_path_key(task: AllgatherTask) -> tuple:
    return task.n_scheduled_ags, task.allgather_acc_mem, task.free_cost, task.node.name


def _fallback_key(task: AllgatherTask) -> tuple:
    return task.free_acc_mem, task.n_scheduled_ags, task.allgather_acc_mem, task.free_cost, task.node.name


def _long_lived_blockers(chosen: AllgatherTask, tasks: list[AllgatherTask]) -> list[Node]:
    """The gathers on ``chosen``'s path to its release that are no candidate: each one's last use needs more
    gathers than any candidate's (a value read again later, as the tied embedding by the output head)."""
    candidates = {t.node for t in tasks}
    return [n for n in chosen.schedule_until_free if util.is_allgather_node(n) and n not in candidates]


def _time(nodes: list[Node]) -> float:
    return sum(n.meta.get("device_time", 0.0) for n in nodes)


def _gathered_bytes(nodes: list[Node]) -> int:
    return sum(n.meta["tensor_size"] for n in nodes if util.is_allgather_node(n))


def make_graph_from_schedule(scheduled: list[Node]) -> Graph:
    graph = Graph()
    env: dict[Node, Node] = {}
    for node in scheduled:
        env[node] = graph.node_copy(node, env.__getitem__)
    return graph


def fast_free_schedule(graph: Graph, available_mem: int, output_size: int, debug_log: bool) -> Graph:
    """A new graph with ``graph``'s nodes in the order above (``available_mem`` and ``output_size`` are
    DeepSpeed's arguments, unused there as here)."""
    result = make_graph_from_schedule(fast_free_order(graph))
    result.lint()
    return result


def reorder_in_place(graph: Graph, order: list[Node]) -> None:
    """Move ``graph``'s nodes into ``order`` (every node once, the output last): for a compiler that holds the
    graph object itself (inductor's post-grad pass), where a new graph would not be seen."""
    output = util.get_output_node(graph)
    for node in order:
        if node is not output:
            output.prepend(node)
    graph.lint()


def fast_free_order(graph: Graph) -> list[Node]:
    """``graph``'s nodes in the order above."""
    for node in graph.nodes:
        node.meta.setdefault("tensor_size", 0)  # a node the profile did not reach
    last_use, _ = util.get_last_uses(graph)
    real_uses = util.get_real_uses(graph)

    scheduled = [n for n in graph.nodes if n.op == "placeholder"]
    placed = set(scheduled)

    unreleased = [n for n in graph.nodes if util.is_release_node(n)]

    def place(nodes: list[Node]) -> None:
        for n in nodes:
            if n not in placed:
                scheduled.append(n)
                placed.add(n)
        # a release whose value has no reader left to place goes now (dsrun's releases are no reader's input:
        # nothing else would pull them forward)
        for release in [r for r in unreleased if r not in placed]:
            if all(n in placed for n in _inputs(release, real_uses)):
                scheduled.append(release)
                placed.add(release)
        unreleased[:] = [r for r in unreleased if r not in placed]

    def gathers_needed(node: Node) -> set[Node]:
        return {n for n in _requirements(node, placed, real_uses) if util.is_allgather_node(n)}

    pending = [n for n in graph.nodes if util.is_allgather_node(n)]
    releases: dict[int, list[Node]] = {}
    for n in graph.nodes:
        if util.is_release_node(n):
            releases.setdefault(util.ds_id_of(n), []).append(n)
    ahead_of_last_use = {ag: gathers_needed(last_use.get(ag, ag)) for ag in pending}
    waiting = {n: gathers_needed(n) for n in graph.nodes if util.is_reduce_node(n)}
    outputs = [n for n in util.get_output_node(graph).args[0] if isinstance(n, Node) and not util.is_reduce_node(n)] \
        if isinstance(util.get_output_node(graph).args[0], (list, tuple)) else []
    waiting.update({n: gathers_needed(n) for n in outputs})

    def settle(gather: Node) -> None:  # ``gather`` placed: what waited on it may go
        pending.remove(gather)
        ahead_of_last_use.pop(gather)
        for needed in ahead_of_last_use.values():
            needed.discard(gather)
        for node, needed in list(waiting.items()):  # a reduce or an output whose gathers are all placed
            needed.discard(gather)
            if not needed:
                place(_requirements(node, placed, real_uses))
                del waiting[node]

    while pending:
        counts = {ag: len(ahead_of_last_use[ag]) for ag in pending}
        tasks: list[AllgatherTask] = []
        for count in sorted(set(counts.values())):
            for ag in (a for a in pending if counts[a] == count):
                until_ag = _requirements(ag, placed, real_uses)
                use = last_use.get(ag, ag)
                until_use = _requirements(use, placed | set(until_ag), real_uses)
                until_free = until_ag + until_use
                for release in releases.get(util.ds_id_of(ag), []):
                    until_free += _requirements(release, placed | set(until_free), real_uses)
                tasks.append(AllgatherTask(ag, _time(until_ag), _time(until_use), ag.meta["tensor_size"],
                                           _gathered_bytes(until_ag), _gathered_bytes(until_use), use,
                                           sum(1 for n in until_free if util.is_allgather_node(n)), until_ag,
                                           until_free))
            if tasks:
                break
        free_paths = [t for t in tasks if t.free_acc_mem == 0]
        if free_paths:
            chosen = min(free_paths, key=_free_path_key)
            place(chosen.schedule_until_free)
            settle(chosen.node)
            continue
        chosen = min(tasks, key=_fallback_key)
        long_lived = _long_lived_blockers(chosen, tasks)
        for gather in long_lived:  # dsrun's rule: the gathers read again later first, the choice's path then free
            place(_requirements(gather, placed, real_uses))
            settle(gather)
        if not long_lived:  # DeepSpeed's fallback: the choice's gather alone
            place(chosen.schedule_until_ag)
            settle(chosen.node)

    place([n for n in graph.nodes if n not in placed])
    return scheduled
