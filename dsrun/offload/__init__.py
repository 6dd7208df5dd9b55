"""ZeRO-Offload and ZeRO-Infinity: optimizer state (and, at stage 3, parameters) on the host or in files.

* :mod:`.swap_store` — :class:`SwapStore`, tensors in files under ``nvme_path`` through the async I/O op.
* :mod:`.param_swapper` — where a ZeRO-3 parameter's shard lives with ``offload_param`` (CPU or NVMe).
* :mod:`.flat_store` / :mod:`.shard_store` — where a stage's optimizer state lives (``offload_optimizer``):
  stages 1-2's partitions and stage 3's sub-groups, on the device, in host memory or in NVMe swap files.
* :mod:`.state_moves` — a strategy's states moved to host memory and back on request (DeepSpeed's
  ``engine.offload_states()`` / ``reload_states()``, ``OffloadStateTypeEnum``).
"""
from dsrun.offload.swap_store import SwapStore, remove_stale_folders

__all__ = ["SwapStore", "remove_stale_folders"]
