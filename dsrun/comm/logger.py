"""The comms logger: counts every collective that goes through :mod:`dsrun.comm`.

For each op name it keeps the number of calls, the message bytes (the tensor the caller handed in, as
DeepSpeed's comms logger reports "message size") and the traffic bytes this rank sends under the
bandwidth-optimal (ring) algorithm, the same factors nccl-tests use for "bus bandwidth":

=================  =====================================
all_reduce         2 * S * (N - 1) / N
reduce_scatter     S_in * (N - 1) / N   (S_in - own piece when pieces differ in size)
all_gather         S_out * (N - 1) / N
broadcast, reduce  S
=================  =====================================

So ZeRO stage 0 (one all-reduce of the gradients) and stages 1-2 (a reduce-scatter of the gradients plus
an all-gather of the parameters) both show 2 * psi * bytes * (N - 1) / N per step, as the theory says.
Latency is measured for synchronous calls only (an async call returns before the work is done).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class OpStats:
    """Totals for one op name."""

    count: int = 0
    message_bytes: int = 0
    traffic_bytes: float = 0.0
    latency_s: float = 0.0
    timed_calls: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "message_bytes": self.message_bytes,
                "traffic_bytes": self.traffic_bytes, "latency_s": self.latency_s}


@dataclass
class CommsLogger:
    """Accounting of collectives. Counting is always on (it is a few additions per call); ``enabled``
    (the ``comms_logger`` config section) adds printing: ``verbose`` prints each call as it happens."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = field(default_factory=list)
    debug: bool = False
    stats: dict[str, OpStats] = field(default_factory=dict)

    def configure(self, enabled: bool = False, verbose: bool = False, prof_all: bool = True,
                  prof_ops: Iterable[str] = (), debug: bool = False) -> None:
        self.enabled, self.verbose, self.prof_all, self.debug = enabled, verbose, prof_all, debug
        self.prof_ops = list(prof_ops)

    def _profiled(self, op: str) -> bool:
        return self.prof_all or op in self.prof_ops

    def record(self, op: str, message_bytes: int, traffic_bytes: float, latency_s: float | None = None) -> None:
        stats = self.stats.setdefault(op, OpStats())
        stats.count += 1
        stats.message_bytes += int(message_bytes)
        stats.traffic_bytes += float(traffic_bytes)
        if latency_s is not None:
            stats.latency_s += latency_s
            stats.timed_calls += 1
        if self.enabled and self.verbose and self._profiled(op):
            lat = f" | latency {latency_s * 1e3:.3f} ms" if latency_s is not None else ""
            print(f"[dsrun.comm] {op} | msg {message_bytes} B | traffic {traffic_bytes:.0f} B{lat}", flush=True)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A copy of the totals, op name -> {count, message_bytes, traffic_bytes, latency_s}."""
        return {op: s.as_dict() for op, s in self.stats.items()}

    def reset(self) -> None:
        self.stats.clear()

    def total_traffic_bytes(self) -> float:
        return sum(s.traffic_bytes for s in self.stats.values())

    def summary(self) -> str:
        """A table like DeepSpeed's ``log_summary``: one row per op."""
        lines = [f"{'op':<16}{'count':>8}{'message MB':>14}{'traffic MB':>14}{'avg latency ms':>16}"]
        for op in sorted(self.stats):
            if not self._profiled(op):
                continue
            s = self.stats[op]
            avg = (s.latency_s / s.timed_calls * 1e3) if s.timed_calls else float("nan")
            lines.append(f"{op:<16}{s.count:>8}{s.message_bytes / 2**20:>14.3f}{s.traffic_bytes / 2**20:>14.3f}"
                         f"{avg:>16.3f}")
        return "\n".join(lines)


class Timer:
    """Wall time of a synchronous call, for the logger."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.start
