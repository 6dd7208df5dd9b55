"""Does an estimate fit this machine? A verdict against the host's RAM (psutil) and the device's memory.

When the ranks run on the CPU (no accelerator), device memory *is* host RAM, so a host needs
``ranks_per_node * max(peak + offloaded, init)``. With an accelerator, each rank's peak is compared with one
device's memory and the host needs ``ranks_per_node * max(offloaded, init)``.

"fits" leaves at least 10% of the budget free (allocator fragmentation, the runtime, other processes);
"tight" fits in the total but not with that margin, or only in RAM that is not free right now;
"too big" needs more than the total.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.estimate.peak import Breakdown

MARGIN = 0.9
FITS, TIGHT, NO_FIT = "fits", "tight", "too big"


@dataclass(frozen=True)
class MemoryBudget:
    """What one host offers: RAM ``host_total`` / ``host_available`` and, with an accelerator, one
    device's memory ``device_total`` (None when ranks run on the CPU); ``device_name`` for messages."""

    host_total: int
    host_available: int
    device_total: int | None = None
    device_name: str = "cpu"


def detect_budget() -> MemoryBudget:
    """This machine's budget: psutil for RAM, the first CUDA device (if any) for device memory."""
    import psutil
    import torch

    vm = psutil.virtual_memory()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return MemoryBudget(vm.total, vm.available, int(props.total_memory), props.name)
    return MemoryBudget(vm.total, vm.available)


@dataclass(frozen=True)
class Verdict:
    """``level`` is "fits", "tight" or "too big"; ``host_need`` / ``device_need`` are the bytes
    compared (device_need None on CPU); ``reason`` says which budget decided it."""

    level: str
    host_need: int
    device_need: int | None
    reason: str


def _level(need: int, total: int, available: int) -> str:
    if need <= MARGIN * min(total, available):
        return FITS
    if need <= total:
        return TIGHT
    return NO_FIT


def judge(estimate: Breakdown, budget: MemoryBudget) -> Verdict:
    """The verdict for ``estimate`` on a host with ``budget`` (see the module docstring)."""
    gib = 2**30
    if budget.device_total is None:
        per_rank = max(estimate.peak_per_rank + estimate.host_per_rank, estimate.init_per_rank)
        need = per_rank * estimate.ranks_per_node
        level = _level(need, budget.host_total, budget.host_available)
        return Verdict(level, need, None,
                       f"{estimate.ranks_per_node} ranks on the CPU need {need / gib:.2f} GiB of "
                       f"{budget.host_total / gib:.2f} GiB RAM ({budget.host_available / gib:.2f} GiB free)")
    host_need = estimate.host_per_host
    host_level = _level(host_need, budget.host_total, budget.host_available)
    device_level = _level(estimate.peak_per_rank, budget.device_total, budget.device_total)
    order = (FITS, TIGHT, NO_FIT)
    level = max(host_level, device_level, key=order.index)
    if order.index(device_level) >= order.index(host_level):
        reason = (f"{estimate.peak_per_rank / gib:.2f} GiB per rank on {budget.device_name} "
                  f"({budget.device_total / gib:.2f} GiB)")
    else:
        reason = f"{host_need / gib:.2f} GiB host RAM of {budget.host_total / gib:.2f} GiB"
    return Verdict(level, host_need, estimate.peak_per_rank, reason)
