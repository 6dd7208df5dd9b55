"""The comms logger: counts every collective that goes through :mod:`dsrun.comm`.

For each op name it keeps the number of calls, the message bytes (the tensor the caller handed in, as
DeepSpeed's comms logger reports "message size") and the traffic bytes this rank sends under the
bandwidth-optimal (ring) algorithm, the same factors nccl-tests use for "bus bandwidth":

=================  =====================================
all_reduce         2 * S * (N - 1) / N
reduce_scatter     S_in * (N - 1) / N   (S_in - own piece when pieces differ in size)
all_gather         S_out * (N - 1) / N
all_to_all_single  S_in * (N - 1) / N   (the pieces for the other ranks)
broadcast, reduce  S
all_to_all_single  S_in - own piece
=================  =====================================

So ZeRO stage 0 (one all-reduce of the gradients) and stages 1-2 (a reduce-scatter of the gradients plus
an all-gather of the parameters) both show 2 * psi * bytes * (N - 1) / N per step, as the theory says.
Latency is measured for synchronous calls; while the logger is enabled an async call is waited on inside
the timer (as DeepSpeed does: logged ops are synchronised), so every logged call has a latency.

Per (op, message size) the logger also keeps each call's latency, for DeepSpeed's summary table
(:meth:`CommsLogger.summary_data`, :func:`format_summary`): count, total latency, and the 10%-trimmed means
of latency, algorithmic bandwidth (message bytes / time) and bus bandwidth (traffic bytes / time, which
is nccl-tests' busbw: ``algbw * 2(N-1)/N`` for all-reduce, ``algbw * (N-1)/N`` for all-gather and
reduce-scatter, ``algbw`` for broadcast and reduce). Bandwidths are in Gbps (10^9 bits per second).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

COLUMN = 20  # DeepSpeed's summary columns are 20 characters, left-justified
SUMMARY_HEADER = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                  "tput_avg (Gbps)", "busbw_avg (Gbps)"]
STRAGGLER_HEADER = ["Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)",
                    "Avg comm lat(ms)", "Avg straggler(ms)"]


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
class SizeStats:
    """Calls of one op with one message size: how many, their traffic, and each timed call's latency (ms) with
    its algorithm and bus bandwidths (Gbps): DeepSpeed's record ``[count, latencies, algbws, busbws]``."""

    count: int = 0
    traffic_bytes: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    algbws: list[float] = field(default_factory=list)
    busbws: list[float] = field(default_factory=list)
    caller: str = ""


def convert_size(size_bytes: float) -> str:
    """Binary units as DeepSpeed prints message sizes: ``2.0 KB``, ``678.86 MB``, ``0 B``."""
    if size_bytes <= 0:
        return "0 B"
    units = ["B", "KB", "MB", "GB", "TB", "PB"]
    index = 0
    while size_bytes >= 1024 and index < len(units) - 1:
        size_bytes /= 1024
        index += 1
    return f"{round(size_bytes, 2)} {units[index]}"


def trim_mean(values: Sequence[float], proportion: float = 0.1) -> float:
    """Mean after cutting ``proportion`` of the values from each end (scipy's ``trim_mean``)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    cut = int(proportion * len(ordered))
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def _caller() -> str:
    """The first function outside dsrun.comm on the stack (``debug`` mode's ``[Caller Func: ...]``)."""
    frame = sys._getframe(1)  # walking frames: inspect.stack() would read every source file on the way
    while frame is not None and "/dsrun/comm/" in frame.f_code.co_filename.replace("\\", "/"):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


@dataclass
class CommsLogger:
    """Accounting of collectives. Counting is always on (it is a few additions per call); ``enabled``
    (the ``comms_logger`` config section) adds timing of every profiled op, ``verbose`` prints each call
    as it happens, ``debug`` records the calling function."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = field(default_factory=list)
    debug: bool = False
    stats: dict[str, OpStats] = field(default_factory=dict)
    by_size: dict[tuple[str, int], SizeStats] = field(default_factory=dict)
    # per (op, the global ranks of the group it ran over): which groups carried what (MiCS, hpZ)
    by_group: dict[tuple[str, tuple[int, ...]], OpStats] = field(default_factory=dict)
    rank: int = 0

    def configure(self, enabled: bool = False, verbose: bool = False, prof_all: bool = True,
                  prof_ops: Iterable[str] = (), debug: bool = False) -> None:
        self.enabled, self.verbose, self.prof_all, self.debug = enabled, verbose, prof_all, debug
        self.prof_ops = list(prof_ops)

    def _profiled(self, op: str) -> bool:
        return self.prof_all or op in self.prof_ops

    # DeepSpeed's switches of what is profiled: every op, or the named ones
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = list(dict.fromkeys([*self.prof_ops, *op_name_list]))

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in set(op_name_list)]

    def timing(self, op: str) -> bool:
        """Whether calls of ``op`` are timed synchronously (the logger is on and profiles this op)."""
        return self.enabled and self._profiled(op)

    def record(self, op: str, message_bytes: int, traffic_bytes: float, latency_s: float | None = None,
               group: tuple[int, ...] | None = None) -> None:
        """Count one call; ``group``: the global ranks of the process group it ran over (None: not known)."""
        stats = self.stats.setdefault(op, OpStats())
        stats.count += 1
        stats.message_bytes += int(message_bytes)
        stats.traffic_bytes += float(traffic_bytes)
        if group is not None:
            per_group = self.by_group.setdefault((op, tuple(group)), OpStats())
            per_group.count += 1
            per_group.message_bytes += int(message_bytes)
            per_group.traffic_bytes += float(traffic_bytes)
        per_size = self.by_size.setdefault((op, int(message_bytes)), SizeStats())
        per_size.count += 1
        per_size.traffic_bytes += float(traffic_bytes)
        if latency_s is not None:
            stats.latency_s += latency_s
            stats.timed_calls += 1
            if self.timing(op):
                per_size.latencies_ms.append(latency_s * 1e3)
                per_size.algbws.append(gbps(message_bytes, latency_s))
                per_size.busbws.append(gbps(traffic_bytes, latency_s))
        if self.enabled and self.debug and not per_size.caller:
            per_size.caller = _caller()
        if self.enabled and self.verbose and self._profiled(op) and latency_s is not None:
            print(self.verbose_line(op, message_bytes, traffic_bytes, latency_s), flush=True)

    def verbose_line(self, op: str, message_bytes: int, traffic_bytes: float, latency_s: float) -> str:
        """One call in DeepSpeed's format (two spaces before ``| busbw``, as upstream prints)."""
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        name = op + (f" | [Caller Func: {_caller()}]" if self.debug else "")
        return (f"[{stamp}] [INFO] [dsrun.comm] [Rank {self.rank}] rank={self.rank} | comm op: {name} | "
                f"time (ms): {latency_s * 1e3:.2f} | msg size: {convert_size(message_bytes)} | "
                f"algbw (Gbps): {gbps(message_bytes, latency_s):.2f}  | busbw (Gbps): "
                f"{gbps(traffic_bytes, latency_s):.2f}")

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A copy of the totals, op name -> {count, message_bytes, traffic_bytes, latency_s}."""
        return {op: s.as_dict() for op, s in self.stats.items()}

    def group_snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """Totals per op and group: op name -> {"0,1": {count, message_bytes, traffic_bytes, latency_s}}, the
        key naming the group's global ranks."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (op, ranks), s in sorted(self.by_group.items()):
            out.setdefault(op, {})[",".join(map(str, ranks))] = s.as_dict()
        return out

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Collectives inside are plumbing, not the job's traffic (the run directory a rank made by torchrun
        receives from rank 0): the totals are as they were before it."""
        saved = copy.deepcopy((self.stats, self.by_size, self.by_group))
        try:
            yield
        finally:
            for table, before in zip((self.stats, self.by_size, self.by_group), saved):
                table.clear()
                table.update(before)

    def reset(self) -> None:
        self.stats.clear()
        self.by_size.clear()
        self.by_group.clear()

    def total_traffic_bytes(self) -> float:
        return sum(s.traffic_bytes for s in self.stats.values())

    def summary_data(self) -> dict[str, Any]:
        """DeepSpeed's summary as data: ``{op: {count, message_bytes, traffic_bytes, sizes: [...]}}``, each
        size row ``{message_bytes, count, total_latency_ms, avg_latency_ms, algbw_gbps, busbw_gbps}`` with
        the averages as 10%-trimmed means over the timed calls; rows sorted by message size."""
        ops: dict[str, Any] = {}
        for (op, size), s in sorted(self.by_size.items()):
            if not self._profiled(op):
                continue
            totals = self.stats[op]
            entry = ops.setdefault(op, {"count": totals.count, "message_bytes": totals.message_bytes,
                                        "traffic_bytes": totals.traffic_bytes, "sizes": []})
            row = {"message_bytes": size, "count": s.count,
                   "total_latency_ms": sum(s.latencies_ms),
                   "avg_latency_ms": trim_mean(s.latencies_ms),
                   "algbw_gbps": trim_mean(s.algbws),
                   "busbw_gbps": trim_mean(s.busbws),
                   "timed_calls": len(s.latencies_ms)}
            if s.caller:
                row["caller"] = s.caller
            entry["sizes"].append(row)
        return ops

    def latencies(self) -> dict[str, list[float]]:
        """Each timed call's latency per ``"op|size"`` key (what the straggler analysis compares)."""
        return {f"{op}|{size}": [t / 1e3 for t in s.latencies_ms] for (op, size), s in self.by_size.items()
                if s.latencies_ms}

    def summary(self) -> str:
        return format_summary(self.summary_data())

    # DeepSpeed's record API: ``comms_dict`` is {op: {message size: [count, [latency ms], [algbw], [busbw]]}}
    @property
    def comms_dict(self) -> dict[str, dict[int, list]]:
        """The records in DeepSpeed's layout (fresh lists: changing them changes nothing here)."""
        out: dict[str, dict[int, list]] = {}
        for (op, size), s in sorted(self.by_size.items()):
            out.setdefault(op, {})[size] = [s.count, list(s.latencies_ms), list(s.algbws), list(s.busbws)]
        return out

    @comms_dict.setter
    def comms_dict(self, records: dict[str, dict[int, list]]) -> None:
        """Replace the records with ones in DeepSpeed's layout (a saved ``get_raw_data()``); the traffic of a
        call is what its bus bandwidth and latency give back."""
        self.reset()
        for op, sizes in records.items():
            for size, (count, latencies, algbws, busbws) in sizes.items():
                traffic = sum(bw * 1e9 / 8 * t / 1e3 for bw, t in zip(busbws, latencies))
                self.by_size[(op, int(size))] = SizeStats(int(count), traffic, list(latencies), list(algbws),
                                                          list(busbws))
                stats = self.stats.setdefault(op, OpStats())
                stats.count += int(count)
                stats.message_bytes += int(size) * int(count)
                stats.traffic_bytes += traffic
                stats.latency_s += sum(latencies) / 1e3
                stats.timed_calls += len(latencies)

    def get_raw_data(self) -> dict[str, dict[int, list]]:
        return self.comms_dict

    def has_data(self) -> bool:
        return bool(self.by_size)

    def reset_data(self) -> None:
        self.reset()

    def get_operation_names(self) -> list[str]:
        return list(dict.fromkeys(op for op, _ in sorted(self.by_size)))

    def get_total_operations(self) -> int:
        return sum(s.count for s in self.by_size.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, float | int | str]] | None:
        """Per message size of one op: count, total and (10%-trimmed) mean latency in ms, mean algorithm and bus
        bandwidth in Gbps, the size in bytes and as DeepSpeed prints it; None for an op never recorded."""
        rows = {size: s for (op, size), s in sorted(self.by_size.items()) if op == operation_name}
        if not rows:
            return None
        return {size: {"count": s.count, "total_latency_ms": sum(s.latencies_ms),
                       "avg_latency_ms": trim_mean(s.latencies_ms), "tput_avg_gbps": trim_mean(s.algbws),
                       "busbw_avg_gbps": trim_mean(s.busbws), "msg_size_bytes": size,
                       "msg_size_str": convert_size(size)} for size, s in rows.items()}


def _cells(values: Sequence[Any]) -> str:
    return "".join(str(v).ljust(COLUMN) for v in values).rstrip()


def format_summary(data: dict[str, Any], straggler: dict[str, Any] | None = None) -> str:
    """DeepSpeed's ``log_summary`` table (and its straggler section when ``straggler`` is given)."""
    lines = [_cells(SUMMARY_HEADER)]
    for op, entry in data.items():
        caller = next((r["caller"] for r in entry["sizes"] if r.get("caller")), "")
        lines.append(op + (f" | [Caller Func: {caller}]" if caller else ""))
        for row in entry["sizes"]:
            lines.append(_cells(["", convert_size(row["message_bytes"]), row["count"],
                                 f"{row['total_latency_ms']:.2f}", f"{row['avg_latency_ms']:.2f}",
                                 f"{row['algbw_gbps']:.2f}", f"{row['busbw_gbps']:.2f}"]))
    if straggler is not None:
        lines += ["_______________________________", "Breakdown with straggler effect",
                  "-------------------------------", _cells(STRAGGLER_HEADER)]
        for op, rows in straggler.items():
            lines.append(op)
            for row in rows:
                lines.append(_cells(["", convert_size(row["message_bytes"]), row["count"],
                                     f"{row['total_latency_ms']:.2f}", f"{row['total_straggler_ms']:.2f}",
                                     f"{row['avg_latency_ms']:.2f}", f"{row['avg_straggler_ms']:.2f}"]))
    return "\n".join(lines)


def straggler_breakdown(own: dict[str, list[float]], every_rank: Sequence[dict[str, list[float]]]
                        ) -> dict[str, list[dict[str, Any]]]:
    """DeepSpeed's straggler effect: per call, this rank's latency minus the fastest rank's for the same
    call (how long it waited for the slowest arrival), summed and trimmed-averaged per op and size."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key in sorted(own, key=lambda k: (k.split("|")[0], int(k.split("|")[1]))):
        op, size = key.split("|")
        mine = own[key]
        n = min(len(rank.get(key, [])) for rank in every_rank) if every_rank else 0
        n = min(n, len(mine))
        if not n:
            continue
        fastest = [min(rank[key][i] for rank in every_rank) for i in range(n)]
        waits = [mine[i] - fastest[i] for i in range(n)]
        out.setdefault(op, []).append({"message_bytes": int(size), "count": n,
                                       "total_latency_ms": sum(mine[:n]) * 1e3,
                                       "total_straggler_ms": sum(waits) * 1e3,
                                       "avg_latency_ms": trim_mean(mine[:n]) * 1e3,
                                       "avg_straggler_ms": trim_mean(waits) * 1e3})
    return out


class Timer:
    """Wall time of a synchronous call, for the logger."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.start
