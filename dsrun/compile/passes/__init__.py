"""DeepCompile's graph passes, each a function ``(gm, graph_id, graph_order, profiling_results,
create_inputs_fn, mem_budget, param_manager, bwd) -> gm`` with a ``NAME`` and a ``CONTRACT``
(:mod:`.contract`). :func:`run_opt_passes` applies a step's passes to one graph, left to right;
:func:`refused_pass` makes the passes of DeepSpeed's that dsrun refuses, with their reason."""
from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from dsrun.utils.errors import ConfigError, Problem


def refused_pass(function_name: str, pass_name: str, reason: str, suggestion: str) -> Callable[..., GraphModule]:
    """DeepSpeed's pass ``function_name`` (scheduled as ``pass_name``) where dsrun cannot run it: its contract
    still takes part in a schedule's check, and running it raises one ``ConfigError`` naming it, the reason and
    what to use instead."""

    def refuse(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn, mem_budget: float,
               param_manager, bwd: bool) -> GraphModule:
        raise ConfigError(Problem(f"compile schedule pass '{pass_name}'", reason, suggestion))

    refuse.__name__ = refuse.__qualname__ = function_name
    return refuse


def run_opt_passes(graph_id: int, gm: GraphModule, opt_passes: list[tuple[Callable, float]], graph_order,
                   profiling_results, create_inputs_fn, param_manager, bwd: bool) -> GraphModule:
    for opt_pass, mem_budget in opt_passes:
        made = opt_pass(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd)
        if made is not None:  # None (DeepSpeed's): the pass changed the graph in place, or not at all
            gm = made
        gm.graph.lint()
        gm.recompile()
    return gm
