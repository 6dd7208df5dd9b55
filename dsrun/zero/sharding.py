"""Which group ZeRO-3 partitions a parameter over, and where its all-gathers run.

* **Plain ZeRO-3**: every parameter over the data-parallel group (MoE experts over their expert-data group).
* **MiCS** (``mics_shard_size`` S): parameters, gradients and optimizer state are partitioned over *shard
  groups* of S consecutive data-parallel ranks and replicated across the D/S groups. A gather runs inside
  the shard group; a gradient is reduce-scattered inside it (every micro-step, as at plain stage 3) and the
  accumulated shard gradient is then all-reduced across the *replica group* (the ranks holding the same
  shard) once per optimizer step. Each rank holds psi/S of the parameters instead of psi/D.
  ``mics_hierarchical_params_gather``: a shard group spanning nodes gathers inside each node first and
  then across nodes (:func:`dsrun.comm.all_gather_hierarchical`); the node size is ``LOCAL_WORLD_SIZE``.
* **hpZ** (``zero_hpz_partition_size`` H, ZeRO++): parameters stay partitioned over the data-parallel
  group, but every forward gather also leaves each rank a *secondary* partition of the full value over a
  group of H consecutive ranks (H elements-per-rank = psi/H). Backward gathers read that one, so they run
  inside the H-rank group (a node) only. The secondary copy is stale after each optimizer step (or any
  write to the shard) until the next forward gather refreshes it.

The groups come from :class:`dsrun.comm.ProcessGroups` (:meth:`~dsrun.comm.ProcessGroups.shard`,
:meth:`~dsrun.comm.ProcessGroups.shard_replicas`, :meth:`~dsrun.comm.ProcessGroups.shard_node_groups`).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.comm.groups import ProcessGroups, expert_parallel_size_of
from dsrun.config.zero import shard_size_problem
from dsrun.utils.errors import ConfigError, Problem

from dsrun.zero.partition_params import partition_numel

if TYPE_CHECKING:
    from .base import StrategyContext

ZP = "zero_optimization"


class Stage3Sharding:
    """The groups of one stage-3 run (built collectively at initialize: every rank the same sizes)."""

    def __init__(self, groups: ProcessGroups | None, data_group: ProcessGroup, shard_size: int = -1,
                 hierarchical: bool = False, hpz_size: int = 1, ranks_per_node: int | None = None):
        self.groups = groups
        self.data_group = data_group
        dp = comm.get_world_size(data_group)
        self.mics = int(shard_size) > 0 and int(shard_size) != dp
        self.hpz = int(hpz_size) > 1 and int(hpz_size) != dp
        if int(shard_size) > 0:
            _check_divides(f"{ZP}.mics_shard_size", int(shard_size), dp)
        if int(hpz_size) > 1:
            _check_divides(f"{ZP}.zero_hpz_partition_size", int(hpz_size), dp)
        if self.mics and self.hpz:
            raise ConfigError(Problem(f"{ZP}.zero_hpz_partition_size",
                                      "hpZ and MiCS (mics_shard_size) cannot be combined",
                                      "use one: MiCS shards within groups, hpZ keeps a secondary partition"))
        hierarchical = bool(hierarchical) and int(shard_size) > 0
        if (self.mics or self.hpz or hierarchical) and groups is None:
            groups = self.groups = ProcessGroups()
        self.shard_group = groups.shard(shard_size) if self.mics else data_group
        self.shard_size = int(shard_size) if self.mics else dp
        self.shard_rank = comm.get_rank(self.shard_group)
        self.replica_group = groups.shard_replicas(shard_size) if self.mics else None
        self.replicas = dp // self.shard_size
        self.gather_levels = None
        if hierarchical:  # (a shard group of the whole data-parallel group too)
            per_node = int(ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE", self.shard_size))
            if per_node < self.shard_size:  # the shard group spans nodes: two levels
                if self.shard_size % per_node:
                    raise ConfigError(Problem(f"{ZP}.mics_hierarchical_params_gather",
                                              f"shard groups of {self.shard_size} ranks do not split into nodes of "
                                              f"{per_node}", "use a mics_shard_size that is a multiple of the ranks "
                                              "per node, or turn the hierarchical gather off"))
                self.gather_levels = groups.shard_node_groups(self.shard_size, per_node)
        self.secondary_group = groups.shard(hpz_size) if self.hpz else None
        self.secondary_size = int(hpz_size) if self.hpz else 1

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> "Stage3Sharding":
        zc = ctx.zero_config
        return cls(ctx.groups, ctx.group, int(zc.mics_shard_size), bool(zc.mics_hierarchical_params_gather),
                   int(zc.zero_hpz_partition_size))

    def group_of(self, param: torch.nn.Parameter) -> ProcessGroup:
        """The group ``param`` is partitioned over."""
        if expert_parallel_size_of(param) is not None:
            if self.mics or self.hpz:
                raise ConfigError(Problem(f"{ZP}.mics_shard_size" if self.mics else f"{ZP}.zero_hpz_partition_size",
                                          "MiCS and hpZ do not partition MoE expert parameters",
                                          "turn them off for a model with experts"))
            return self.groups.group_of_param(param) if self.groups is not None else self.data_group
        return self.shard_group

    def attach(self, param: torch.nn.Parameter) -> None:
        """Give a partitioned parameter its gather plan: hierarchical levels (MiCS) or a secondary partition
        (hpZ). A parameter partitioned elsewhere (under ``zero.Init``) must match the plan."""
        if expert_parallel_size_of(param) is not None:
            return
        if param.ds_world_size != self.shard_size:
            raise ConfigError(Problem(f"{ZP}.mics_shard_size",
                                      f"a parameter was partitioned over {param.ds_world_size} ranks (zero.Init), "
                                      f"the engine partitions over {self.shard_size}",
                                      "build the model under dsrun.zero.MiCS_Init with the same config"))
        param.ds_gather_levels = self.gather_levels
        if self.hpz:
            param.ds_secondary_group = self.secondary_group
            param.ds_secondary_world_size = self.secondary_size
            param.ds_secondary_rank = comm.get_rank(self.secondary_group)
            param.ds_secondary_tensor = torch.zeros(partition_numel(param.ds_numel, self.secondary_size),
                                                    dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)
            param.ds_secondary_valid = False

    def reduce_across_replicas(self, grads: list[torch.Tensor]) -> None:
        """MiCS: sum the shard gradients over the replica group (each holds this step's sum for its ranks)."""
        if not self.mics or self.replicas == 1:
            return
        for g in grads:
            comm.all_reduce(g, group=self.replica_group)

    def secondary_bytes(self, params: list[torch.nn.Parameter]) -> int:
        """Bytes of the hpZ secondary partitions this rank holds."""
        return sum(p.ds_secondary_tensor.numel() * p.ds_secondary_tensor.element_size() for p in params
                   if getattr(p, "ds_secondary_tensor", None) is not None)


def _check_divides(key: str, size: int, dp: int) -> None:
    problem = shard_size_problem(key, size, dp)  # the rule config --validate runs too
    if problem is not None:
        raise ConfigError(problem)
