"""TensorBoard events under ``<output_path>/<job_name>/`` through ``torch.utils.tensorboard``.

The writer keeps its own queue and writes from a background thread; :meth:`flush` forces the file out.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .base import Event, Monitor, require_package


class TensorBoardMonitor(Monitor):
    name = "tensorboard"

    def __init__(self, output_path: str | os.PathLike = "", job_name: str = "DeepSpeedJobName"):
        require_package("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # imported only when the sink is on

        self.log_dir = Path(output_path or os.getcwd()) / job_name
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, events: Sequence[Event]) -> None:
        for label, value, step in events:
            self.writer.add_scalar(label, float(value), int(step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {key}: {value}" for key, value in params.items())  # indented: markdown code
        self.writer.add_text("params", text, 0)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
