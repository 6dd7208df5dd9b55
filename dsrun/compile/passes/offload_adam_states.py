"""DeepSpeed's optimizer-state offload passes (``offload_adam_states``, its ``_sync`` and ``_for_init`` forms):
their contracts, and a refusal. DeepSpeed moves Adam's states to pinned host memory around the compiled graph;
dsrun moves a strategy's states with ``engine.offload_states()``/``reload_states()`` and keeps them on the host
with ``offload_optimizer``; with DeepCompile the passes, and ``compile.offload_opt_states``, are refused."""
from __future__ import annotations

from dsrun.compile.passes import refused_pass
from dsrun.compile.passes.contract import CAP_OPT_STATES_EVICTED, PassContract

NAME = "offload_adam_states"
NAME_SYNC = "offload_adam_states_sync"
NAME_FOR_INIT = "offload_adam_states_for_init"
# the states these passes move exist only at ZeRO-3 (DeepSpeed's init_z3 sets them up), and one offload target
_INCOMPATIBLE = frozenset({"offload_parameters", "zero1_compile", "zero2_compile"})
CONTRACT = PassContract(requires=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)
CONTRACT_SYNC = PassContract(conflicts_with=_INCOMPATIBLE | {NAME})
CONTRACT_FOR_INIT = PassContract(provides=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)
REASON = "DeepCompile's optimizer-state offload is not in dsrun"
SUGGESTION = "use zero_optimization.offload_optimizer, or engine.offload_states()"

move_opt_states = refused_pass("move_opt_states", NAME, REASON, SUGGESTION)
move_opt_states_sync = refused_pass("move_opt_states_sync", NAME_SYNC, REASON, SUGGESTION)
offload_adam_states_for_init = refused_pass("offload_adam_states_for_init", NAME_FOR_INIT, REASON, SUGGESTION)
