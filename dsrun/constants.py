"""``deepspeed.constants``: the launcher's default rendezvous port and the environment names it sets per node."""
from __future__ import annotations

from dsrun.launcher.options import DEFAULT_MASTER_PORT

TORCH_DISTRIBUTED_DEFAULT_PORT = DEFAULT_MASTER_PORT
# set by dsrun's per-node agent (dsrun/launcher/agent.py): this node's index and the number of nodes
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"

#: ZeRO-3 on the CPU: the cap of the cache of freed host blocks, in modules' gathered bytes (a module's gathered
#: parameters, the collectives' flat copies and autograd's full weight gradients; dsrun/zero/host_memory.py, which
#: the memory estimator counts too)
ZERO3_HOST_CACHE_MODULES = 6
