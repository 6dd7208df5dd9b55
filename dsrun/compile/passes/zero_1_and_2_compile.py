"""DeepSpeed's ZeRO-1/2 reduce passes (``zero1_compile``, ``zero2_compile``): their contracts, and a refusal.

DeepSpeed's insert its reduce ops into the compiled backward. dsrun's ZeRO-1/2 strategies reduce each gradient
from the hook that fires when it reaches the parameter, which a compiled backward feeds as an eager one does, so
DeepCompile at stages 1-2 compiles the whole module with no reduce pass (:mod:`dsrun.compile.init`); a
schedule naming these passes is refused with that reason.
"""
from __future__ import annotations

from torch.fx import GraphModule

from dsrun.compile.passes.contract import PassContract
from dsrun.utils.errors import ConfigError, Problem

NAME_Z1 = "zero1_compile"
NAME_Z2 = "zero2_compile"
CONTRACT_Z1 = PassContract(conflicts_with=frozenset({"zero3_compile"}))
CONTRACT_Z2 = PassContract(conflicts_with=frozenset({"zero3_compile", NAME_Z1}))
REASON = ("dsrun's ZeRO-1/2 gradients are reduced by the stage's hooks, which the compiled backward feeds: "
          "DeepCompile runs no reduce pass at stages 1-2")


def _refuse(name: str) -> None:
    raise ConfigError(Problem(f"compile schedule pass '{name}'", REASON, "leave it out of the schedule"))


def add_z1_reduce(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                  mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    _refuse(NAME_Z1)
    return gm


def add_z2_reduce(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                  mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    _refuse(NAME_Z2)
    return gm
