"""The measuring profilers (DeepSpeed's ``ProfilingInterpreter``/``MemoryProfilingInterpreter``) on dsrun's own
handle, accelerator and graph ops, in-process and without a process group (DeepSpeed's
``unit/v1/compile/test_graph_profile.py`` checks the same classes with stand-ins for all three)."""
from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

from dsrun.compile import handle as handle_mod
from dsrun.compile.ops import ALLGATHER, RELEASE
from dsrun.compile.profilers import graph_profile
from dsrun.zero.partition_params import partition_param

KEYS = ("device_time", "wall_time", "alloc_mem", "max_mem", "tensor_size")


@pytest.fixture
def handle(monkeypatch: pytest.MonkeyPatch) -> handle_mod.DeepCompileHandle:
    fresh = handle_mod.DeepCompileHandle()  # the process's handle is left as it was
    monkeypatch.setattr(handle_mod, "_HANDLE", fresh)
    return fresh


def _gather_matmul_graph(ds_id: int, fail: bool = False) -> GraphModule:
    """``x @ gather(w)``, the gathered ``w`` released after its reader (as the ZeRO-3 pass writes it)."""
    def broken(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (synthetic)")

    graph = Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    full = graph.call_function(ALLGATHER, (w, ds_id))
    y = graph.call_function(broken if fail else torch.matmul, (x, full))
    graph.call_function(RELEASE, (full, ds_id))
    graph.output(y)
    return GraphModule(torch.nn.Module(), graph)


def test_profiling_interpreter_measures_a_gathered_graph_and_leaves_the_handle_as_it_was(handle) -> None:
    weight = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
    expected_weight = weight.detach().clone()
    partition_param(weight)
    handle.register_z3_param(weight)
    stats_before = handle.stats
    gm = _gather_matmul_graph(weight.ds_id)
    x = torch.ones(2, 3)

    out = graph_profile.ProfilingInterpreter(gm, iteration=2, warmup=1).run(x, weight)

    assert torch.equal(out, x @ expected_weight)
    assert not graph_profile.is_profile_incomplete(gm.graph)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert all(key in n.meta for n in gm.graph.nodes for key in KEYS)
    assert nodes["matmul"].meta["tensor_size"] == 2 * 4 * 4  # a 2x4 float32 output
    assert nodes["allgather_param_default"].meta["tensor_size"] == 3 * 4 * 4
    assert nodes["matmul"].meta["wall_time"] >= 0.0
    assert nodes["release_param_default"].meta["alloc_mem"] == -nodes["allgather_param_default"].meta["alloc_mem"]
    # the warm-up and timed runs gathered several times; none of it shows in the step's counts
    assert not handle.profiling and handle.stats is stats_before and stats_before.releases == 0


def test_a_failed_node_leaves_the_graph_incomplete_and_the_memory_record_empty(handle) -> None:
    weight = torch.nn.Parameter(torch.ones(3, 4))
    partition_param(weight)
    handle.register_z3_param(weight)
    gm = _gather_matmul_graph(weight.ds_id, fail=True)

    assert graph_profile.ProfilingInterpreter(gm, iteration=1, warmup=0).run(torch.ones(2, 3), weight) is None
    assert graph_profile.is_profile_incomplete(gm.graph)
    assert all(key in n.meta for n in gm.graph.nodes for key in KEYS)  # backfilled: the passes can read any node

    memory = graph_profile.MemoryProfilingInterpreter(gm)
    assert memory.run(torch.ones(2, 3), weight) is None
    assert not memory.profile_complete and memory.mem_record == [] and not handle.profiling

    good = _gather_matmul_graph(weight.ds_id)
    memory = graph_profile.MemoryProfilingInterpreter(good)
    memory.run(torch.ones(2, 3), weight)
    assert memory.profile_complete and [row[0] for row in memory.mem_record] == [n.name for n in good.graph.nodes]


def test_nothing_is_reduced_while_profiling() -> None:
    handle, got = handle_mod.DeepCompileHandle(), []
    handle.init(lambda p, g: got.append(g), release_buckets=lambda: got.append("released"))
    weight = torch.nn.Parameter(torch.ones(4))
    partition_param(weight)
    handle.register_z3_param(weight)

    handle.enable_profiling(True)
    handle.reduce_grad(weight.ds_id, torch.ones(4))
    handle.end_backward(0, release_reduce_buckets=True)
    handle.enable_profiling(False)
    assert got == [] and handle.stats.reduced == 0 and handle.stats.backward_ends == 0

    handle.reduce_grad(weight.ds_id, torch.ones(4))
    handle.end_backward(0, release_reduce_buckets=True)
    assert len(got) == 2 and got[1] == "released" and handle.stats.reduced == 1
