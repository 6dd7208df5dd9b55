"""TensorBoard events under ``<output_path>/<job_name>/`` through ``torch.utils.tensorboard``.

The writer keeps its own queue and writes from a background thread; :meth:`flush` forces the file out.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .base import Event, Monitor, PathSection, deepspeed_section, require_package, writes_here


class TensorBoardMonitor(Monitor):
    name = "tensorboard"

    def __init__(self, output_path: str | os.PathLike[str] | PathSection = "", job_name: str = "DeepSpeedJobName"):
        """``TensorBoardMonitor(output_path, job_name)``, or DeepSpeed's ``TensorBoardMonitor(tensorboard_config)``
        (then it writes only when the section is enabled, on rank 0)."""
        section = deepspeed_section(output_path)
        if section is not None:
            output_path, job_name = section.output_path, section.job_name
        self.enabled, self.output_path, self.job_name = bool(section.enabled) if section else True, output_path, job_name
        self.writer: Any = None
        if section is not None and not writes_here(section):
            return
        require_package("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # imported only when the sink is on

        self.log_dir = Path(output_path or os.getcwd()) / job_name
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, events: Sequence[Event]) -> None:
        if self.writer is None:
            return
        for label, value, step in events:
            self.writer.add_scalar(label, float(value), int(step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.writer is None:
            return
        text = "\n".join(f"    {key}: {value}" for key, value in params.items())  # indented: markdown code
        self.writer.add_text("params", text, 0)

    def flush(self) -> None:
        if self.writer is None:
            return
        self.writer.flush()

    def close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
