"""DeepSpeed's CSV monitor: one file per metric under ``<output_path>/<job_name>/``.

The file name is the label with ``/`` and spaces turned into ``_`` plus ``.csv``
(``Train/Samples/train_loss`` → ``Train_Samples_train_loss.csv``); the first row is ``step,<last label
component>`` (``step,train_loss``), then one ``step,value`` row per event, appended, so a resumed run keeps
its history. Rows are buffered in memory and written on :meth:`flush`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .base import Event, Monitor, PathSection, deepspeed_section, writes_here


def csv_file_name(label: str) -> str:
    return label.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor(Monitor):
    """Writes ``<output_path>/<job_name>/<label>.csv``; ``output_path`` empty means the current directory."""

    name = "csv_monitor"

    def __init__(self, output_path: str | os.PathLike[str] | PathSection = "", job_name: str = "DeepSpeedJobName"):
        """``CSVMonitor(output_path, job_name)``, or DeepSpeed's ``csvMonitor(csv_config)`` (then it writes only
        when the section is enabled, on rank 0)."""
        section = deepspeed_section(output_path)
        if section is not None:
            output_path, job_name = section.output_path, section.job_name
        self.enabled, self.output_path, self.job_name = bool(section.enabled) if section else True, output_path, job_name
        self.log_dir = Path(output_path or os.getcwd()) / job_name
        self._writes = section is None or writes_here(section)
        if self._writes:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, list[str]] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        if not self._writes:
            return
        for label, value, step in events:
            self._pending.setdefault(label, []).append(f"{int(step)},{float(value)!r}\n")

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for label, rows in pending.items():
            path = self.log_dir / csv_file_name(label)
            new = not path.exists()
            with open(path, "a", encoding="utf-8") as handle:
                if new:
                    handle.write(f"step,{label.split('/')[-1]}\n")
                handle.writelines(rows)


csvMonitor = CSVMonitor  # DeepSpeed's class name
