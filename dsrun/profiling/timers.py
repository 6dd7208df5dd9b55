"""Wall-clock timers for ``wall_clock_breakdown``: named, start/stop, averaged and printed by the engine."""
from __future__ import annotations

import time

from dsrun.accelerator import get_accelerator


class _Timer:
    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.lifetime = 0.0  # never reset (the autotuning probe takes per-step differences)
        self._start: float | None = None

    def start(self) -> None:
        get_accelerator().synchronize()
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            return
        get_accelerator().synchronize()
        elapsed = time.perf_counter() - self._start
        self.total += elapsed
        self.lifetime += elapsed
        self.count += 1
        self._start = None


class WallClockTimers:
    """Timers by name. When disabled every call is a no-op, so the engine can call them unconditionally."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.timers: dict[str, _Timer] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            self.timers.setdefault(name, _Timer()).start()

    def stop(self, name: str) -> None:
        if self.enabled and name in self.timers:
            self.timers[name].stop()

    def elapsed_ms(self, name: str) -> float:
        """Total milliseconds recorded under ``name`` since the last reset."""
        timer = self.timers.get(name)
        return 0.0 if timer is None else timer.total * 1e3

    def lifetime_ms(self, name: str) -> float:
        """Total milliseconds recorded under ``name`` since the engine started (not reset)."""
        timer = self.timers.get(name)
        return 0.0 if timer is None else timer.lifetime * 1e3

    def mean_ms(self) -> dict[str, float]:
        return {name: t.total * 1e3 / t.count for name, t in self.timers.items() if t.count}

    def reset(self) -> None:
        for timer in self.timers.values():
            timer.total, timer.count = 0.0, 0

    def report(self, names: list[str]) -> str:
        means = self.mean_ms()
        return "time (ms) | " + " | ".join(f"{n}: {means[n]:.2f}" for n in names if n in means)
