"""DeepSpeed's ``offload_parameters`` pass (its contract, and a refusal): it moves each parameter's shard from the
accelerator to host memory after its forward use and back for the backward. dsrun's ZeRO-3 keeps shards in host
memory or NVMe with ``offload_param`` (eager ZeRO-3); with DeepCompile the pass, and ``compile.offload_parameters``,
are refused."""
from __future__ import annotations

from dsrun.compile.passes import refused_pass
from dsrun.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "offload_parameters"
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))

offload_parameter_fwd = refused_pass("offload_parameter_fwd", NAME, "DeepCompile's parameter offload is not in dsrun",
                                     "use zero_optimization.offload_param with eager ZeRO-3")
