"""DeepSpeed's ``offload_parameters`` pass (its contract, and a refusal): it moves each parameter's shard from the
accelerator to host memory after its forward use and back for the backward. dsrun's ZeRO-3 keeps shards in host
memory or NVMe with ``offload_param`` (eager ZeRO-3); with DeepCompile the pass, and ``compile.offload_parameters``,
are refused."""
from __future__ import annotations

from torch.fx import GraphModule

from dsrun.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract
from dsrun.utils.errors import ConfigError, Problem

NAME = "offload_parameters"
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))


def offload_parameter_fwd(gm: GraphModule, graph_id: int, graph_order, profiling_results, create_inputs_fn,
                          mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    raise ConfigError(Problem(f"compile schedule pass '{NAME}'", "DeepCompile's parameter offload is not in dsrun",
                              "use zero_optimization.offload_param with eager ZeRO-3"))
