"""The run glue ``dsrun.worker`` composes: one :class:`~dsrun.workloads.base.Workload` per run (see
:mod:`dsrun.workloads.base`). :func:`compose` picks it from the RunSpec."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from .base import Workload
from .distill import Distillation
from .gpt import DenseGPT
from .pipeline import PipelinedGPT, pipeline_stages


def compose(spec: DictConfig, ds_config: dict[str, Any], world_size: int) -> Workload:
    """The pipelined GPT (``model.pipeline_stages`` > 1), a distillation (``train.teacher``) or the dense GPT."""
    if pipeline_stages(spec.model) > 1:  # with a teacher refused by the RunSpec (dsrun.runspec)
        return PipelinedGPT(spec, ds_config, world_size)
    if spec.train.teacher:
        return Distillation(spec, ds_config, world_size)
    return DenseGPT(spec, ds_config, world_size)


__all__ = ["DenseGPT", "Distillation", "PipelinedGPT", "Workload", "compose"]
