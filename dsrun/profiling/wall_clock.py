"""Reporting the ``wall_clock_breakdown`` timers: means over the last ``steps_per_print`` steps, as a log
line and as DeepSpeed's monitor events ``Train/Samples/elapsed_time_ms_<timer>``.

The engine's timers (:class:`dsrun.profiling.timers.WallClockTimers`) keep a total and a call count per name;
the mean is per call (per micro-step for forward and backward, per ``engine.step()`` call for step).
"""
from __future__ import annotations

from typing import Mapping, Sequence

# DeepSpeed's order: forward, backward (= backward_inner + backward_allreduce), step
BREAKDOWN_TIMERS: tuple[str, ...] = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
EVENT_PREFIX = "Train/Samples/elapsed_time_ms_"


def breakdown_line(means_ms: Mapping[str, float], rank: int = 0, names: Sequence[str] = BREAKDOWN_TIMERS) -> str:
    """``rank=0 time (ms) | forward: 12.31 | backward: 30.02 | ...`` (DeepSpeed's layout)."""
    cells = " | ".join(f"{name}: {means_ms[name]:.2f}" for name in names if name in means_ms)
    return f"rank={rank} time (ms) | {cells}"


def breakdown_events(means_ms: Mapping[str, float], step: int,
                     names: Sequence[str] = BREAKDOWN_TIMERS) -> list[tuple[str, float, int]]:
    """The monitor events for the means, at x-axis ``step`` (global samples)."""
    return [(EVENT_PREFIX + name, float(means_ms[name]), int(step)) for name in names if name in means_ms]
