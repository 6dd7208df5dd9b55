"""``deepspeed.utils.pin_memory_tracker``: the process-wide count of host memory pinned through the
accelerator's ``pin_memory``.

Pinned memory is page-locked: it is never swapped out and counts against the host's memlock limit. A host
running out of memory often fails far from what pinned it, so the running total is logged at DEBUG on every
pin and at INFO each time it reaches the next milestone: 32 GB, then each doubling (64, 128, ...), so even
millions of small pins give a handful of lines. :meth:`dsrun.accelerator.Accelerator.pin_memory` reports here.
"""
from __future__ import annotations

from dsrun.utils.logging import logger

_GB = 1024**3
_CHECKPOINT_BASE_GB = 32  # the first milestone; each later one doubles it


def _fmt_bytes(num_bytes: int) -> str:
    """``512 B``, ``2.0 KB``, ``1.00 MB``, ``1.000 GB``: DeepSpeed's wording, one more digit per unit."""
    for unit, size, digits in (("GB", _GB, 3), ("MB", 1024**2, 2), ("KB", 1024, 1)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{digits}f} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    """The running total (``_bytes``), the number of pins (``_calls``) and the next milestone to log."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = _CHECKPOINT_BASE_GB * _GB

    def track(self, num_bytes: int) -> None:
        self._bytes += num_bytes
        self._calls += 1
        logger.debug(f"pin_memory: +{_fmt_bytes(num_bytes)} "
                     f"(call #{self._calls}, running total: {_fmt_bytes(self._bytes)})")
        while self._bytes >= self._next_checkpoint:  # one line per milestone crossed, even in one call
            logger.info(f"[pinned-memory checkpoint] crossed {_fmt_bytes(self._next_checkpoint)}: "
                        f"{_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        prefix = f"[pinned-memory {tag}] " if tag else "[pinned-memory] "
        logger.info(f"{prefix}{_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    """Count ``num_bytes`` more pinned host memory."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the total pinned so far (INFO), prefixed with ``tag``."""
    _tracker.log_summary(tag)
