"""``train.teacher``: a student GPT initialised from a teacher run's model (``compression_training`` with its
layer reduction) and trained on the distillation loss (docs/compression.md). The student is built whole (not
under ``zero.Init``: the layer reduction copies the teacher's layers into it) and reads whole sequences."""
from __future__ import annotations

from typing import TYPE_CHECKING

import hydra.utils
import torch
from torch import nn

from .gpt import DenseGPT

if TYPE_CHECKING:
    from dsrun.compression.layer_reduction import Distiller
    from dsrun.engine.engine import DeepSpeedEngine


class Distillation(DenseGPT):
    distiller: Distiller | None = None

    def build_model(self) -> nn.Module:
        from dsrun.compression.compress import init_compression
        from dsrun.compression.layer_reduction import Distiller, load_teacher

        self.model = hydra.utils.instantiate(self.spec.model, _convert_="all")
        teacher = load_teacher(self.cfg.teacher)
        init_compression(self.model, self.ds_config, teacher_model=teacher)
        self.distiller = Distiller(teacher, self.cfg.kd_weight, self.cfg.kd_temperature)
        return self.model

    def attach(self, engine: DeepSpeedEngine) -> None:
        super().attach(engine)
        self.shard = False  # the teacher reads whole sequences

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.distiller.loss(self.engine, inputs, targets)
