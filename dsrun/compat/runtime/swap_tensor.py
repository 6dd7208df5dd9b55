"""``deepspeed.runtime.swap_tensor``: ``MIN_SWAPPABLE_BYTES`` (home: :mod:`dsrun.offload.nvme`; dsrun's NVMe swapping
itself is :mod:`dsrun.offload`)."""
from dsrun.offload.nvme import MIN_SWAPPABLE_BYTES

__all__ = ["MIN_SWAPPABLE_BYTES"]
