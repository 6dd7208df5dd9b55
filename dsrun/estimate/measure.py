"""Predicted versus measured peak memory per rank: the comparison behind ``--measure``.

Launching a few real steps belongs to the engine and the worker; this module gives them the two ends:

* in each rank: ``start = current_rss()`` before building the model, then after the steps
  ``record_rank_peak(run_dir, rank, start)``. On CUDA the recorded peak is
  ``torch.cuda.max_memory_allocated()`` (device memory); on CPU it is the whole process's own peak resident
  memory (``VmHWM``): runtime, data, model states, activations and buffers together, which is what the
  host must provide for that rank and what the estimate's ``rank_peak`` predicts. ``start`` (the resident
  memory before the model was built) is recorded next to it. glibc is told to return large blocks at once
  (``MALLOC_MMAP_THRESHOLD_=65536`` in the rank's environment), so the peak follows tensor memory;
* in the estimator: :func:`load_measured_peaks` reads those files back (or one JSON file
  ``{"peak_bytes_per_rank": {"0": 123, "1": 456}}``, or a list in rank order), :func:`compare_peaks`
  pairs them with the prediction and :func:`comparison_table` renders the rows with the error
  ``(predicted - measured) / measured`` in percent.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from dsrun.utils.errors import UserError, Problem

DEFAULT_TOLERANCE_PCT = 15.0
PEAK_FILE_PREFIX = "memory_peak_rank"


def current_rss() -> int:
    """This process's resident memory now, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def used_cuda() -> bool:
    """Whether this process initialised CUDA (then its peak is device memory, not RSS)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())


def rank_peak_bytes(baseline_rss: int = 0) -> int:
    """This rank's peak memory: CUDA's peak allocation if it used CUDA, else its peak RSS minus
    ``baseline_rss`` (0: the whole process's peak, as ``record_rank_peak`` records it)."""
    import torch

    if used_cuda():
        return int(torch.cuda.max_memory_allocated())
    return peak_rss_bytes() - baseline_rss


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current resident memory (Linux ``clear_refs``: 5), so a later
    :func:`peak_rss_bytes` sees only what came after. False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's own peak resident memory.

    On Linux this is ``VmHWM`` (the address space's high-water mark), not ``getrusage``'s ``ru_maxrss``:
    the latter survives fork + exec, so a rank started by a launcher or agent would report its parent's peak
    whenever that was higher than its own.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak * (1 if sys.platform == "darwin" else 1024))  # bytes on macOS, KiB elsewhere


def write_rank_peak(directory: str | Path, rank: int, peak_bytes: int, **extra: int | float | str) -> Path:
    """Record one rank's measured peak as ``<directory>/memory_peak_rank<rank>.json`` (``extra``: more
    fields, e.g. ``start_bytes`` and ``device``)."""
    path = Path(directory) / f"{PEAK_FILE_PREFIX}{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": int(rank), "peak_bytes": int(peak_bytes), **extra}))
    return path


@dataclass(frozen=True)
class PeakComparison:
    """One rank of one case: ``predicted`` and ``measured`` peak bytes and the signed error in percent."""

    case: str
    rank: int
    predicted: int
    measured: int

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted - self.measured) / self.measured

    def within(self, tolerance_pct: float = DEFAULT_TOLERANCE_PCT) -> bool:
        return abs(self.error_pct) <= tolerance_pct

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "rank": self.rank, "predicted": self.predicted, "measured": self.measured,
                "error_pct": round(self.error_pct, 2)}


def compare_peaks(predicted: int | Mapping[int, int], measured: Mapping[int, int],
                  case: str = "recipe") -> list[PeakComparison]:
    """Pair each measured rank with its prediction (one number for all ranks, or one per rank)."""
    rows = []
    for rank in sorted(measured):
        pred = predicted if isinstance(predicted, int) else predicted[rank]
        if measured[rank] <= 0:
            raise UserError(Problem(f"measured rank {rank}", f"peak must be positive, got {measured[rank]}"))
        rows.append(PeakComparison(case, int(rank), int(pred), int(measured[rank])))
    return rows


def record_rank_peak(run_dir: str | Path, rank: int, start_rss: int = 0) -> Path:
    """What a rank calls at the end of its run: write its peak into the run directory. ``peak_bytes`` is
    the device's peak allocation on CUDA, else the process's whole peak RSS; ``start_bytes`` the resident
    memory the rank had before building the model (``start_rss``), ``device`` "cuda" or "cpu"."""
    cuda = used_cuda()
    return write_rank_peak(run_dir, rank, rank_peak_bytes(0), start_bytes=int(start_rss),
                           device="cuda" if cuda else "cpu")


def load_measured_peaks(source: str | Path | Mapping[str, Any]) -> dict[int, int]:
    """Per-rank measured peaks from a run directory holding ``memory_peak_rank*.json`` files, a JSON file,
    or an already-loaded dict (see the module docstring)."""
    if not isinstance(source, Mapping) and Path(source).is_dir():
        files = sorted(Path(source).glob(f"{PEAK_FILE_PREFIX}*.json"))
        if not files:
            raise UserError(Problem(str(source), f"no {PEAK_FILE_PREFIX}*.json files in this directory",
                                    "the ranks record them with dsrun.estimate.measure.record_rank_peak"))
        peaks = {}
        for file in files:
            record = json.loads(file.read_text())
            peaks[int(record["rank"])] = int(record["peak_bytes"])
        return peaks
    if isinstance(source, Mapping):
        data: Any = source
        where = "measured peaks"
    else:
        where = str(source)
        try:
            data = json.loads(Path(source).read_text())
        except FileNotFoundError:
            raise UserError(Problem(where, "file not found", "give the JSON written by a measured run")) from None
        except json.JSONDecodeError as err:
            raise UserError(Problem(where, f"not valid JSON ({err.msg} at line {err.lineno})")) from None
    peaks = data.get("peak_bytes_per_rank") if isinstance(data, Mapping) else None
    if isinstance(peaks, Sequence) and not isinstance(peaks, str):
        peaks = dict(enumerate(peaks))
    if not isinstance(peaks, Mapping) or not peaks:
        raise UserError(Problem(where, "expected {\"peak_bytes_per_rank\": {\"0\": BYTES, ...}}"))
    try:
        return {int(rank): int(value) for rank, value in peaks.items()}
    except (TypeError, ValueError):
        raise UserError(Problem(where, "ranks and peaks must be integers")) from None


def worst_error_pct(rows: Sequence[PeakComparison]) -> float:
    """The largest absolute error over ``rows``, in percent."""
    return max(abs(row.error_pct) for row in rows)


def comparison_table(rows: Sequence[PeakComparison], tolerance_pct: float = DEFAULT_TOLERANCE_PCT) -> Any:
    """A rich table: case, rank, predicted, measured, error %, and whether it is within the tolerance."""
    from rich.table import Table

    from dsrun.estimate.report import format_bytes

    table = Table(title=f"predicted vs measured peak per rank (tolerance {tolerance_pct:g}%)", title_justify="left")
    for name in ("case", "rank", "predicted", "measured", "error", "ok"):
        table.add_column(name, justify="left" if name in ("case", "ok") else "right")
    for row in rows:
        ok = row.within(tolerance_pct)
        table.add_row(row.case, str(row.rank), format_bytes(row.predicted), format_bytes(row.measured),
                      f"{row.error_pct:+.1f}%", "[green]yes[/]" if ok else "[red]no[/]")
    return table
