"""The bytes a ZeRO-Infinity run moves through its NVMe swap files, from the swap stores' own counters.

A stage-3 strategy with NVMe offload owns up to two :class:`~dsrun.offload.swap_store.SwapStore` s: the
parameter shards' (``offload_param``, :mod:`dsrun.offload.param_swapper`) and the optimizer's masters, states
and gradients (``offload_optimizer``, :mod:`dsrun.offload.nvme`). Each counts every byte and request it reads
and writes (``store.io``); :class:`SwapTraffic` adds them up and gives the traffic of each optimizer step as
the difference from the last boundary. The engine's observer writes it as ``Train/Samples/nvme_read_bytes``
and ``Train/Samples/nvme_written_bytes`` (docs/zero_infinity.md); ``benchmarks/infinity_disk.py`` divides it by
the disk's measured bandwidth.
"""
from __future__ import annotations

from dsrun.offload.param_swapper import NvmeParamOffload
from dsrun.offload.shard_store import NvmeShardStore
from dsrun.offload.swap_store import SwapIO, SwapStore
from dsrun.zero.base import ZeroStrategy


def swap_stores(strategy: ZeroStrategy | None) -> list[SwapStore]:
    """The NVMe swap stores ``strategy`` moves data through (none without NVMe offload or a strategy)."""
    stores: list[SwapStore] = []
    param_offload = getattr(strategy, "param_offload", None)  # stage 3 only
    if isinstance(param_offload, NvmeParamOffload):
        stores.append(param_offload.store)
    placement = getattr(strategy, "placement", None)
    if placement is not None and isinstance(placement.offloaded, NvmeShardStore):
        stores.append(placement.offloaded.swapped.store)
    return stores


class SwapTraffic:
    """Per-step NVMe traffic of a strategy: ``step()`` returns what moved since the previous call."""

    def __init__(self, strategy: ZeroStrategy | None):
        self.stores = swap_stores(strategy)
        self._last = self.total()

    @property
    def active(self) -> bool:
        return bool(self.stores)

    def total(self) -> SwapIO:
        """Everything the stores moved since they opened (model construction and checkpoint loads included)."""
        io = SwapIO()
        for store in self.stores:
            io = io + store.io
        return io

    def step(self) -> SwapIO:
        """The traffic since the last call (or since this object was made): one optimizer step's, when called
        at each boundary."""
        now = self.total()
        moved, self._last = now - self._last, now
        return moved
