"""DeepSpeed's optimizer-state offload passes (``offload_adam_states``, its ``_sync`` and ``_for_init`` forms):
their contracts, and a refusal. DeepSpeed moves Adam's states to pinned host memory around the compiled graph;
dsrun moves a strategy's states with ``engine.offload_states()``/``reload_states()`` and keeps them on the host
with ``offload_optimizer``; with DeepCompile the passes, and ``compile.offload_opt_states``, are refused."""
from __future__ import annotations

from torch.fx import GraphModule

from dsrun.compile.passes.contract import CAP_OPT_STATES_EVICTED, PassContract
from dsrun.utils.errors import ConfigError, Problem

NAME = "offload_adam_states"
NAME_SYNC = "offload_adam_states_sync"
NAME_FOR_INIT = "offload_adam_states_for_init"
# the states these passes move exist only at ZeRO-3 (DeepSpeed's init_z3 sets them up), and one offload target
_INCOMPATIBLE = frozenset({"offload_parameters", "zero1_compile", "zero2_compile"})
CONTRACT = PassContract(requires=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)
CONTRACT_SYNC = PassContract(conflicts_with=_INCOMPATIBLE | {NAME})
CONTRACT_FOR_INIT = PassContract(provides=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)


def _refuse(name: str) -> None:
    raise ConfigError(Problem(f"compile schedule pass '{name}'", "DeepCompile's optimizer-state offload is not in "
                              "dsrun", "use zero_optimization.offload_optimizer, or engine.offload_states()"))


def move_opt_states(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                    mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    _refuse(NAME)
    return gm


def move_opt_states_sync(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                         mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    _refuse(NAME_SYNC)
    return gm


def offload_adam_states_for_init(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                                 mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    _refuse(NAME_FOR_INIT)
    return gm
