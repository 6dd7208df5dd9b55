"""Weights & Biases, as DeepSpeed's ``wandb`` section describes (``team`` is the W&B entity)."""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from .base import Event, Monitor, SinkSection, deepspeed_section, require_package, writes_here


class _WandbSection(SinkSection, Protocol):
    """DeepSpeed's ``wandb`` section object."""

    project: str
    group: str | None
    team: str | None


class WandbMonitor(Monitor):
    name = "wandb"

    def __init__(self, project: str | _WandbSection = "deepspeed", group: str | None = None, team: str | None = None,
                 run_name: str | None = None):
        """``WandbMonitor(project, group, team)``, or DeepSpeed's ``WandbMonitor(wandb_config)`` (then it logs
        only when the section is enabled, on rank 0)."""
        section = deepspeed_section(project)
        if section is not None:
            project, group, team = section.project, section.group, section.team
        self.enabled, self.project, self.group, self.team = (bool(section.enabled) if section else True,
                                                             project, group, team)
        self.run: Any = None
        if section is not None and not writes_here(section):
            return
        require_package("wandb", "wandb")
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team, name=run_name)

    def write_events(self, events: Sequence[Event]) -> None:
        if self.run is None:
            return
        for label, value, step in events:
            self.run.log({label: float(value)}, step=int(step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.run is None:
            return
        self.run.config.update(dict(params), allow_val_change=True)

    def close(self) -> None:
        if self.run is None:
            return
        self.run.finish()
