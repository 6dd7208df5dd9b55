"""Comet, as DeepSpeed's ``comet`` section describes. ``samples_log_interval`` thins the events: one is
sent each time the step (global samples) crosses a multiple of it."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .base import Event, Monitor, require_package


class CometMonitor(Monitor):
    name = "comet"

    def __init__(self, project: str | None = None, workspace: str | None = None, api_key: str | None = None,
                 experiment_name: str | None = None, experiment_key: str | None = None,
                 online: bool | None = None, mode: str | None = None, samples_log_interval: int = 100):
        require_package("comet_ml", "comet")
        import comet_ml

        options: dict[str, Any] = {"project": project, "workspace": workspace, "api_key": api_key,
                                   "experiment_key": experiment_key, "online": online, "mode": mode}
        self.experiment = comet_ml.start(**{k: v for k, v in options.items() if v is not None})
        if experiment_name:
            self.experiment.set_name(experiment_name)
        self.interval = max(1, int(samples_log_interval))
        self._last_bucket: dict[str, int] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        for label, value, step in events:
            bucket = int(step) // self.interval
            if self._last_bucket.get(label) == bucket:
                continue
            self._last_bucket[label] = bucket
            self.experiment.log_metric(label, float(value), step=int(step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.experiment.log_parameters(dict(params))

    def close(self) -> None:
        self.experiment.end()
