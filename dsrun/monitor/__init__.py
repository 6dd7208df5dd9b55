"""Metric sinks: CSV, TensorBoard, MLflow, and W&B / Comet when their packages are installed.

``MonitorMaster(ds_config)`` fans DeepSpeed-style events ``(label, value, step)`` out to every enabled sink,
from rank 0 only, through a writer thread. The sink modules are imported only when their section is on.
"""
from .base import Event, Monitor
from .master import SINK_SECTIONS, MonitorMaster, build_sink

__all__ = ["Event", "Monitor", "MonitorMaster", "SINK_SECTIONS", "build_sink"]
