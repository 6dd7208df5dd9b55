"""DeepCompile's graph passes, each a function ``(gm, graph_id, graph_order, profiling_results,
create_inputs_fn, mem_budget, param_manager, bwd) -> gm`` with a ``NAME`` and a ``CONTRACT``
(:mod:`.contract`). :func:`run_opt_passes` applies a step's passes to one graph, left to right."""
from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule


def run_opt_passes(graph_id: int, gm: GraphModule, opt_passes: list[tuple[Callable, float]], graph_order,
                   profiling_results, create_inputs_fn, param_manager, bwd: bool) -> GraphModule:
    for opt_pass, mem_budget in opt_passes:
        gm = opt_pass(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd)
        gm.graph.lint()
        gm.recompile()
    return gm
