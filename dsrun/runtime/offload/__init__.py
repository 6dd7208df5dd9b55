"""ZeRO-Offload and ZeRO-Infinity: optimizer state (and, at stage 3, parameters) on the host or in files.

* :mod:`.param_swapper` — where a ZeRO-3 parameter's shard lives with ``offload_param`` (CPU or NVMe).
"""
