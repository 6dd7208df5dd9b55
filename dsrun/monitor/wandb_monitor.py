"""Weights & Biases, as DeepSpeed's ``wandb`` section describes (``team`` is the W&B entity)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .base import Event, Monitor, require_package


class WandbMonitor(Monitor):
    name = "wandb"

    def __init__(self, project: str = "deepspeed", group: str | None = None, team: str | None = None,
                 run_name: str | None = None):
        require_package("wandb", "wandb")
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team, name=run_name)

    def write_events(self, events: Sequence[Event]) -> None:
        for label, value, step in events:
            self.run.log({label: float(value)}, step=int(step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def close(self) -> None:
        self.run.finish()
