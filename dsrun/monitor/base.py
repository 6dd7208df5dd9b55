"""The monitor contract shared by every sink: DeepSpeed's ``write_events([(label, value, step), ...])``.

``step`` is the x-axis; the engine uses ``global_samples`` (DeepSpeed's advice: some backends do not accept
mixed step values). A sink may buffer; ``flush()`` makes everything written so far visible and ``close()``
flushes and releases files and connections.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Iterable, Mapping, Protocol, Sequence, Tuple

from dsrun.utils.errors import ConfigError, Problem

Event = Tuple[str, float, int]
# A config, or one of its sections, as the monitors read it: a dict, a pydantic model (dsrun.config) or
# DeepSpeed's config object, read by key or by attribute (:func:`section_value`); so any object.
ConfigLike = object


class SinkSection(Protocol):
    """DeepSpeed's config section object for one sink (``ds_config.monitor_config.tensorboard``)."""

    enabled: bool


class PathSection(SinkSection, Protocol):
    """The section of a sink writing files: ``csv_monitor`` and ``tensorboard``."""

    output_path: str
    job_name: str


class Monitor:
    """A metric sink. Subclasses implement :meth:`write_events`; the rest are optional."""

    name = "monitor"

    def write_events(self, events: Sequence[Event]) -> None:
        raise NotImplementedError

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Run parameters (hyper-parameters, the resolved config); ignored by sinks without the notion."""

    def log_artifacts(self, paths: Iterable[str]) -> None:
        """Files to keep with the run; ignored by sinks without the notion."""

    def flush(self) -> None:
        """Make every event written so far durable."""

    def close(self) -> None:
        self.flush()


def require_package(package: str, section: str) -> None:
    """Fail at configuration time, with the fix, when a monitor's package is missing."""
    if package in sys.modules:  # already imported (or provided by a test double)
        return
    if importlib.util.find_spec(package) is None:
        raise ConfigError(Problem(f"{section}.enabled", f"is true but the '{package}' package is not installed",
                                  f"pip install {package}, or set {section}.enabled to false"))


def section_value(section: ConfigLike | None, name: str, default: object = None) -> Any:
    """Read a key from a config section that may be a dict, a pydantic model, or DeepSpeed's config object."""
    if section is None:
        return default
    if isinstance(section, Mapping):
        return section.get(name, default)
    return getattr(section, name, default)


def deepspeed_section(value: object) -> Any | None:
    """``value`` (a sink's first argument, of any type) when a monitor is built DeepSpeed's way, from its
    config section object (``TensorBoardMonitor(ds_config.monitor_config.tensorboard)``), else None."""
    return value if hasattr(value, "enabled") and not isinstance(value, (str, os.PathLike)) else None


def writes_here(section: SinkSection) -> bool:
    """DeepSpeed's monitors built from a section write only when it is enabled, and only on rank 0."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return bool(section.enabled) and rank == 0
