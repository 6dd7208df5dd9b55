"""The list scheduler and the last-use analysis on dsrun's graph ops (in-process: graphs built by hand, and the
default gpt-nano's forward through ``zero3_compile``)."""
from __future__ import annotations

import pytest
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



def _gathers(g: Graph, sizes: dict[str, int]) -> dict[str, torch.fx.Node]:
    nodes = {}
    for ds_id, (name, size) in enumerate(sizes.items()):
        nodes[name] = g.call_function(ALLGATHER, (g.placeholder(name), ds_id))
        nodes[name].meta["tensor_size"] = size
    return nodes


def _released(g: Graph, gathers: dict[str, torch.fx.Node], out: torch.fx.Node) -> list[str]:
    """``g`` with each gather released at the end and ``out`` its output, in the scheduler's order (names)."""
    for ds_id, gather in enumerate(gathers.values()):
        g.call_function(RELEASE, (gather, ds_id))
    g.output(out)
    for n in g.nodes:
        n.meta.setdefault("tensor_size", 0)
    return [n.name for n in list_schedule.fast_free_order(g)]


def test_a_gather_read_again_at_the_end_goes_first_and_the_others_one_at_a_time() -> None:
    """e is read first and last (a tied embedding and head): every other release needs it. DeepSpeed's fallback
    gathered w1 and w2 at the start; dsrun's places e first, then each weight through its release."""
    g = Graph()
    x = g.placeholder("x")
    ag = _gathers(g, {"e": 4000, "w1": 1000, "w2": 1000})
    h = g.call_function(torch.ops.aten.mm.default, (x, ag["e"]))
    for w in ("w1", "w2"):
        h = g.call_function(torch.ops.aten.mm.default, (h, ag[w]))
    order = _released(g, ag, g.call_function(torch.ops.aten.mm.default, (h, ag["e"])))
    release = {n.args[0].name: n.name for n in g.nodes if n.target is RELEASE}
    assert order.index(ag["e"].name) < order.index(ag["w1"].name)
    assert order.index(release[ag["w1"].name]) < order.index(ag["w2"].name)  # w1 whole only until w2's turn


def test_gathers_read_together_keep_deepspeeds_fallback() -> None:
    """a and b read by one op (each blocks the other, both candidates): DeepSpeed's fallback, unchanged, places
    alone the gather needing the fewest gathered bytes before its release (a: 10, b's; b: 100, a's) first."""
    g = Graph()
    ag = _gathers(g, {"a": 100, "b": 10})
    order = _released(g, ag, g.call_function(torch.ops.aten.add.Tensor, (ag["a"], ag["b"])))
    assert order.index(ag["a"].name) < order.index(ag["b"].name)

@pytest.mark.parametrize("tied", [True, False])
def test_a_weight_read_again_at_the_end_does_not_gather_the_model_at_the_start(world_of_one, tied: bool) -> None:
    """The default gpt-nano's forward through ``zero3_compile``: its token embedding, tied to the output head, is
    read first and last, so every other parameter's release needs it. DeepSpeed's fallback then gathered every
    parameter at the forward's start (97% of the model at once); gathered at the start and held to the head, it
    leaves each layer's parameters gathered one layer at a time, as with an untied head."""
    from dsrun.compile import backend as backend_mod
    from dsrun.compile.handle import get_deepcompile_handle
    from dsrun.compile.passes import zero3_compile
    from dsrun.models.registry import build_model
    from dsrun.zero.partition_params import partition_param

    torch.manual_seed(0)
    model = build_model("gpt-nano", tie_embeddings=tied)
    layers = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    tied_weight = model.transformer.wte.weight.numel() if tied else 0
    handle = get_deepcompile_handle()
    handle.cleanup()
    names = {}
    for name, p in model.named_parameters():
        partition_param(p)
        handle.register_z3_param(p)
        names[id(p)] = name
    handle.init(lambda p, g: None)
    backend_mod.init_schedule([(0, [zero3_compile.add_z3_gather_release])])
    torch._dynamo.reset()
    backend = backend_mod.DeepCompileBackend("eager", names)
    compiled = torch.compile(backend_mod.gathered_forward(model), backend=backend)
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    try:
        compiled(tokens[:, :-1], tokens[:, 1:])
    finally:  # no backward here: its frame no longer awaits one (torch's autograd.Function restored)
        backend_mod.cleanup_compiled_backward_state(owned_frames={f for f in backend_mod.frames_needing_bwd
                                                                   if f[0] is backend})

    live = peak = 0
    for node in backend.profiling_results[0].fwd_graph.nodes:  # the scheduled forward, in order
        if node.target is ALLGATHER:
            live += node.meta["val"].numel()
            peak = max(peak, live)
        elif node.target is RELEASE:
            live -= node.args[0].meta["val"].numel()
    gathers = [n for n in backend.profiling_results[0].fwd_graph.nodes if n.target is ALLGATHER]
    assert live == 0 and len(gathers) == len(list(model.parameters()))  # each parameter gathered once, released
    # at least the tied weight (read by the head at the end: gathered throughout) and the largest layer (one op
    # reads its weight and bias together); the schedule holds nothing more at once
    assert peak == tied_weight + max(layers)
    assert handle.stats.peak_live_numel == peak  # the forward ran in that order
