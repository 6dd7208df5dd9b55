"""Sequence parallelism (DeepSpeed-Ulysses) as a feature of the engine (:mod:`dsrun.features`).

Built when the config's ``sequence_parallel_size`` S is above 1. It asks the engine's topology for a sequence
axis (``group_sizes``: S consecutive ranks of each data group share samples, each holding 1/S of the sequence,
while ZeRO keeps the whole data group), refuses a client's groups that have none, and has gradients reduced
in ``seq_parallel_comm_data_type`` (as DeepSpeed does). DeepSpeed's engine names read the topology:
``engine.sequence_parallel_size``, ``engine.seq_parallel_group`` (``groups.sequence``).
"""
from __future__ import annotations

from torch import nn

from dsrun.comm.groups import ProcessGroups
from dsrun.config import DSConfig
from dsrun.features import Feature
from dsrun.utils.errors import ConfigError, Problem


class SequenceParallelFeature(Feature):
    name = "sequence_parallel"

    def __init__(self, config: DSConfig):
        self._config = config
        self.size = int(config.sequence_parallel_size)

    @classmethod
    def build(cls, config: DSConfig) -> "SequenceParallelFeature | None":
        return cls(config) if int(config.sequence_parallel_size) > 1 else None

    def group_sizes(self) -> dict[str, int]:
        return {"sequence": self.size}

    def take_topology(self, model: nn.Module, groups: ProcessGroups) -> None:  # type: ignore[override]
        if groups.sequence_parallel_size != self.size:  # the groups came from a client mpu
            raise ConfigError(Problem("sequence_parallel_size", f"is {self.size}, but a client mpu (or a pipeline) "
                                      "brings its own data-parallel group; dsrun builds sequence groups only from "
                                      "the whole world", "drop mpu=, or set sequence_parallel_size to 1"))
        self._config.communication_data_type = self._config.seq_parallel_comm_data_type
