"""``MonitorMaster``: DeepSpeed's fan-out to every enabled sink, written only from rank 0.

The step loop must not wait on disks or databases, nor share the interpreter with a busy writer at every
step, so :meth:`MonitorMaster.write_events` only appends the events to a buffer. A writer thread builds
the sinks (importing MLflow and opening its store take seconds, which then overlap with training) and,
every ``flush_interval_s`` (10 s), takes the buffer, passes it to the sinks in one batch and flushes them:
one burst every few seconds instead of a wake-up per step, which on a loaded machine costs the loop
more than the writing itself (the writer would hold the GIL while waiting for a core). :meth:`flush`
waits until everything handed over so far is written; :meth:`close` flushes and closes.

Sinks and their sections (DeepSpeed's, plus dsrun's ``mlflow``)::

    csv_monitor   enabled, output_path, job_name     <output_path>/<job_name>/<label>.csv
    tensorboard   enabled, output_path, job_name     event files in <output_path>/<job_name>/
    wandb         enabled, project, group, team      needs the wandb package
    comet         enabled, project, workspace, ...   needs the comet_ml package
    mlflow        enabled, tracking_uri, experiment_name, run_name, log_artifacts

An empty ``output_path`` means ``default_output_dir`` (the run directory under ``dsrun train``) or, if
that is not given, the current directory. A missing package is a configuration error raised at once, not
from the writer thread.
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from .base import ConfigLike, Event, Monitor, require_package, section_value

SINK_SECTIONS = ("csv_monitor", "tensorboard", "wandb", "comet", "mlflow")
MAX_BUFFERED_EVENTS = 20_000  # hand over early past this many, so a long interval cannot grow memory
# What a request to the writer carries: log_params' dict, log_artifacts' paths, write_events' events, or nothing.
_Payload = Mapping[str, Any] | list[str] | Sequence[Event] | None
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml", "mlflow": "mlflow"}


def _default_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _enabled(config: ConfigLike, section: str) -> bool:
    return bool(section_value(section_value(config, section), "enabled", False))


def build_sink(config: ConfigLike, section: str, default_output_dir: str | None = None,
               mlflow_parent_key: str | None = None) -> Monitor:
    """Construct the sink for one enabled section of ``config`` (a DeepSpeed config, dict or object)."""
    cfg = section_value(config, section)
    get = lambda name, default=None: section_value(cfg, name, default)  # noqa: E731
    output_path = get("output_path") or default_output_dir or ""
    if section == "csv_monitor":
        from .csv_monitor import CSVMonitor

        return CSVMonitor(output_path, get("job_name", "DeepSpeedJobName"))
    if section == "tensorboard":
        from .tensorboard import TensorBoardMonitor

        return TensorBoardMonitor(output_path, get("job_name", "DeepSpeedJobName"))
    if section == "wandb":
        from .wandb_monitor import WandbMonitor

        return WandbMonitor(get("project", "deepspeed"), get("group"), get("team"))
    if section == "comet":
        from .comet_monitor import CometMonitor

        return CometMonitor(get("project"), get("workspace"), get("api_key"), get("experiment_name"),
                            get("experiment_key"), get("online"), get("mode"), get("samples_log_interval", 100))
    if section == "mlflow":
        from .mlflow_monitor import MLflowMonitor, resolve_tracking_uri

        uri = resolve_tracking_uri(get("tracking_uri"), default_output_dir or os.getcwd())
        return MLflowMonitor(uri, get("experiment_name", "dsrun"), get("run_name"), bool(get("log_artifacts", True)),
                             parent_key=mlflow_parent_key)
    raise ValueError(f"unknown monitor section {section!r}; known: {', '.join(SINK_SECTIONS)}")


class MonitorMaster(Monitor):
    """Fans events out to the enabled sinks. On ranks other than 0 (or with no sink enabled) every call is
    a no-op, so callers need no rank checks.

    ``monitor_config`` is a DeepSpeed config (dsrun's :class:`~dsrun.config.DSConfig`, a dict, or
    DeepSpeed's ``ds_config.monitor_config``). ``background=False`` writes synchronously (tests, tools).
    """

    name = "monitor"

    def __init__(self, monitor_config: ConfigLike, *, rank: int | None = None, default_output_dir: str | None = None,
                 mlflow_parent_key: str | None = None, flush_interval_s: float = 10.0, background: bool = True):
        self.rank = _default_rank() if rank is None else rank
        self.sections = [s for s in SINK_SECTIONS if _enabled(monitor_config, s)]
        self.enabled = self.rank == 0 and bool(self.sections)
        for section in self.sections:  # fail now, with the fix, not later in a thread
            if section in PACKAGES:
                require_package(PACKAGES[section], section)
        self.sinks: list[Monitor] = []
        self.errors: list[str] = []
        self.writer_cpu_s = 0.0  # CPU time the writer thread spent writing (sinks built excluded)
        self._flush_interval_s = flush_interval_s
        # runs grouped under one MLflow parent (multirun jobs, tuning trials); see run_defaults.py
        parent = mlflow_parent_key or os.environ.get("DSRUN_MLFLOW_PARENT") or None
        self._factory: Callable[[str], Monitor] = lambda section: build_sink(
            monitor_config, section, default_output_dir, parent)
        self._queue: queue.Queue = queue.Queue()
        self._buffer: list[Event] = []
        self._buffer_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sinks_built = threading.Event()
        self._closed = False
        if not self.enabled:
            return
        if background:
            self._thread = threading.Thread(target=self._run, name="dsrun-monitor", daemon=True)
            self._thread.start()
        else:
            self._build_sinks()
        atexit.register(self.close)  # a script that never calls close() still gets its events written

    # --- the public contract ----------------------------------------------------------------------------
    def write_events(self, events: Sequence[Event]) -> None:
        """Hand over ``(label, value, step)`` events; returns at once."""
        if not self.enabled or not events or self._closed:
            return
        if self._thread is None:
            self._each("write_events", list(events))
            return
        with self._buffer_lock:
            self._buffer.extend(events)
            full = len(self._buffer) >= MAX_BUFFERED_EVENTS
        if full:
            self._queue.put(("drain", None))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.enabled:
            self._submit("log_params", dict(params))

    def log_artifacts(self, paths: Iterable[str]) -> None:
        if self.enabled:
            self._submit("log_artifacts", [str(p) for p in paths])

    def flush(self, timeout: float | None = 120.0) -> None:
        """Wait until everything handed over so far is written (no-op where disabled)."""
        if not self.enabled or self._closed:
            return
        if self._thread is None:
            self._each("flush")
            return
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait(timeout)

    def close(self, timeout: float | None = 300.0) -> None:
        """Flush and close every sink. Safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._thread is None:
            self._each("close")
            return
        self._queue.put(("close", None))
        if not self._sinks_built.is_set():  # a short run ends before e.g. MLflow is imported and its store open
            print(f"[dsrun] closing the monitors: waiting for {', '.join(self.sections)} to start (importing "
                  "and opening them takes seconds on a busy machine)", file=sys.stderr, flush=True)
        self._thread.join(timeout)

    # --- the writer ---------------------------------------------------------------------------------------
    def _submit(self, method: str, payload: _Payload) -> None:
        if self._closed:
            return
        if self._thread is None:
            self._each(method, payload)
        else:
            self._queue.put((method, payload))

    def _build_sinks(self) -> None:
        for section in self.sections:
            try:
                self.sinks.append(self._factory(section))
            except Exception as err:  # a broken sink must not stop training; say so once
                self._report(f"{section} disabled: {type(err).__name__}: {err}")

    def _each(self, method: str, *args: _Payload) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(*args)
            except Exception as err:
                self._report(f"{sink.name}.{method} failed: {type(err).__name__}: {err}")

    def _report(self, message: str) -> None:
        self.errors.append(message)
        print(f"[dsrun.monitor] {message}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        self._build_sinks()
        self._sinks_built.set()
        last_flush = time.monotonic()
        while True:
            wait = max(0.0, self._flush_interval_s - (time.monotonic() - last_flush))
            try:
                method, payload = self._queue.get(timeout=wait)
            except queue.Empty:
                method, payload = "tick", None
            started = time.thread_time()
            try:
                if self._handle(method, payload, last_flush):
                    last_flush = time.monotonic()
            finally:
                self.writer_cpu_s += time.thread_time() - started
            if method == "close":
                return

    def _handle(self, method: str, payload: _Payload, last_flush: float) -> bool:
        """Carry out one request; True when the sinks were flushed."""
        flushed = False
        if method in ("log_params", "log_artifacts"):
            self._each(method, payload)
        with self._buffer_lock:
            events, self._buffer = self._buffer, []
        if events:
            self._each("write_events", events)
        if method in ("tick", "flush", "close") or time.monotonic() - last_flush >= self._flush_interval_s:
            self._each("flush")
            flushed = True
        if method == "flush":
            payload.set()
        if method == "close":
            self._each("close")
        return flushed
