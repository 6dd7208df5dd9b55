"""The list scheduler and the last-use analysis on dsrun's graph ops (in-process, graphs built by hand)."""
from __future__ import annotations

import torch
from torch.fx import Graph

from dsrun.compile import list_schedule, util
from dsrun.compile.backend import _sync_memory_profile_complete
from dsrun.compile.ops import ALLGATHER, RELEASE
from dsrun.compile.profilers.graph_profile import _backfill_missing_profile_metadata, is_profile_incomplete


def _two_layers(released_at_end: bool) -> tuple[Graph, dict[str, torch.fx.Node]]:
    """x -> mm(x, t(w1)) -> mm(., t(w2)); each weight gathered (1000 bytes) and released after its reader, or
    both releases at the end of the graph."""
    g = Graph()
    x, w1, w2 = g.placeholder("x"), g.placeholder("w1"), g.placeholder("w2")
    ag1, ag2 = g.call_function(ALLGATHER, (w1, 1)), g.call_function(ALLGATHER, (w2, 2))
    t1 = g.call_function(torch.ops.aten.t.default, (ag1,))
    h = g.call_function(torch.ops.aten.mm.default, (x, t1))
    t2 = g.call_function(torch.ops.aten.t.default, (ag2,))
    y = g.call_function(torch.ops.aten.mm.default, (h, t2))
    nodes = dict(ag1=ag1, ag2=ag2, t1=t1, h=h, t2=t2, y=y)
    if released_at_end:
        nodes["r1"], nodes["r2"] = g.call_function(RELEASE, (ag1, 1)), g.call_function(RELEASE, (ag2, 2))
    g.output(y)
    for n in g.nodes:
        n.meta["tensor_size"] = 1000 if n.target is ALLGATHER else 0
    return g, nodes


def test_a_view_hands_on_its_last_use() -> None:
    graph, n = _two_layers(released_at_end=False)
    last_use, dead_after = util.get_last_uses(graph)
    assert last_use[n["ag1"]] is n["h"]  # through the transpose (a view) to the matmul that reads it
    assert n["ag1"] in dead_after[n["h"]] and n["ag1"] not in dead_after.get(n["t1"], [])
    assert util.get_real_uses(graph)[n["ag2"]] == [n["y"]]


def test_the_scheduler_frees_each_gather_before_the_next() -> None:
    graph, n = _two_layers(released_at_end=True)
    order = [node.name for node in list_schedule.fast_free_order(graph)]
    # the gathers were both at the top and both releases at the end: now one weight whole at a time
    assert order.index(n["r1"].name) < order.index(n["ag2"].name)
    assert order.index(n["h"].name) < order.index(n["r1"].name)  # never before the reader of its value
    list_schedule.reorder_in_place(graph, list_schedule.fast_free_order(graph))
    assert [node.name for node in graph.nodes] == order


def test_an_incomplete_profile_is_marked_and_filled() -> None:
    graph, n = _two_layers(released_at_end=False)
    assert not is_profile_incomplete(graph)
    _backfill_missing_profile_metadata(graph)  # the nodes lack their times: the profile did not reach them
    assert is_profile_incomplete(graph) and all(node.meta["device_time"] == 0.0 for node in graph.nodes)
    assert _sync_memory_profile_complete(True) and not _sync_memory_profile_complete(False)  # no process group


def test_deepcompile_ops_are_lowered_as_kernels_whose_buffers_are_not_reused() -> None:
    from types import SimpleNamespace

    from torch._inductor.lowering import lowerings

    from dsrun.compile import inductor
    from dsrun.compile.ops import GATHERS, PREFETCH, REDUCE

    inductor.register_custom_ops()
    for op in (*GATHERS, PREFETCH, RELEASE, REDUCE, inductor._get_graphsafe_run_with_rng_state()):
        assert op in lowerings and op in inductor.fallbacks

    class Buffer(inductor.IRNode):
        def get_name(self) -> str:
            return "buf0"

    graph = SimpleNamespace(never_reuse_buffers=set())
    with inductor.V.set_graph_handler(graph):
        assert inductor._mark_output_never_reuse(3, enabled=True) == 3  # not a buffer: as it is
        inductor._mark_output_never_reuse(Buffer(), enabled=False)
        assert graph.never_reuse_buffers == set()
        inductor._mark_output_never_reuse(Buffer(), enabled=True)
    assert graph.never_reuse_buffers == {"buf0"}
