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


def zero3_host_cache_cap(default_bytes: int) -> int:
    """The host cache's cap in bytes: ``DSRUN_HOST_CACHE_MB`` (MiB, 0 turns the cache off) when the environment
    sets it, else ``default_bytes``; a value that is not a size >= 0 is a ConfigError."""
    import os

    from dsrun.utils.errors import ConfigError

    override = os.environ.get("DSRUN_HOST_CACHE_MB")
    if override in (None, ""):
        return int(default_bytes)
    try:
        cap = int(float(override) * (1 << 20))
    except ValueError:
        raise ConfigError(f"DSRUN_HOST_CACHE_MB={override!r}: expected a size in MiB (0 turns the host cache "
                          "off)") from None
    if cap < 0:
        raise ConfigError(f"DSRUN_HOST_CACHE_MB={override!r}: expected a size >= 0 in MiB")
    return cap
