"""Stage 3's sharding policy: which group each parameter is partitioned over, how its gathers run, how its
gradient is reduce-scattered and what the step adds to that.

:class:`ShardingPolicy` is plain ZeRO-3's, the stage-3 strategy's default: every parameter over the
data-parallel group (an MoE expert over its expert-data group), flat all-gathers, the plain reduce-scatter,
nothing more at the step. A feature supplies another through the protocol's ``sharding_policy()`` hook
(:mod:`dsrun.features`; the engine hands it to the strategy as ``StrategyContext.sharding``): ZeRO++'s, with
MiCS shard groups, hpZ secondary partitions and quantized collectives, is :mod:`dsrun.zero.zeropp`'s. The
strategy reads only the methods below and never a config key of the policy's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.comm.groups import ProcessGroups, expert_parallel_size_of
from dsrun.utils.errors import ConfigError, Problem

# a reduce-scatter the policy runs instead of the plain one: (output of C elements, rows (N, C) flat, the bucket's
# key (its parameters, the same from step to step), the loss scale its gradients carry)
ReduceScatter = Callable[[torch.Tensor, torch.Tensor, tuple, float], None]


class ShardingPolicy:
    """Plain ZeRO-3 over the data-parallel group ``data_group`` of ``groups`` (None: every parameter there).

    ``shard_group`` is the group a non-expert parameter is partitioned over (``shard_size`` ranks; the
    step's norm counts each of its shards once over it); ``replicas`` the number of groups holding the same
    shards (1 here)."""

    mics = False  # whether shards are replicated over several shard groups (the checkpoint code refuses to reshard)

    def __init__(self, groups: ProcessGroups | None, data_group: ProcessGroup):
        self.groups = groups
        self.data_group = data_group
        self.shard_group: ProcessGroup = data_group
        self.shard_size = comm.get_world_size(data_group)
        self.replicas = 1
        self.gather_levels: tuple[ProcessGroup, ProcessGroup] | None = None  # a two-level gather's groups

    def group_of(self, param: torch.nn.Parameter) -> ProcessGroup:
        """The group ``param`` is partitioned over: an MoE expert's expert-data group, else the shard group."""
        if expert_parallel_size_of(param) is not None:
            return self.groups.group_of_param(param) if self.groups is not None else self.data_group
        return self.shard_group

    def attach(self, param: torch.nn.Parameter) -> None:
        """Give a partitioned parameter its gather plan. A parameter partitioned elsewhere (under ``zero.Init``)
        must have been cut over as many ranks as this policy cuts it."""
        if expert_parallel_size_of(param) is not None:
            return
        if param.ds_world_size != self.shard_size:
            raise ConfigError(Problem("zero_optimization.mics_shard_size",
                                      f"a parameter was partitioned over {param.ds_world_size} ranks (zero.Init), "
                                      f"the engine partitions over {self.shard_size}",
                                      "build the model under dsrun.zero.MiCS_Init with the same config"))
        param.ds_gather_levels = self.gather_levels

    def prepare(self, params: list[torch.nn.Parameter]) -> None:
        """Once every parameter is partitioned and attached: mark how their gathers are carried (plain: as
        they are) and build what the gradient reduction needs."""

    def reduce_scatter_for(self, group: ProcessGroup) -> ReduceScatter | None:
        """The reduce-scatter to run for a gradient bucket over ``group`` instead of the plain (asynchronous)
        one; None: the plain one."""
        return None

    def check_gradient_stores(self, resident: bool) -> None:
        """``resident``: whether every sub-group's gradient accumulator is in memory (not in swap files)."""

    def after_boundary_reduction(self, grads: list[torch.Tensor]) -> None:
        """At an accumulation boundary, once every bucket's reduce-scatter has landed in ``grads`` (this rank's
        accumulated shard gradients): what the step needs beyond them (plain: nothing)."""

    def secondary_bytes(self, params: list[torch.nn.Parameter]) -> int:
        """Bytes this rank holds beyond its shards (plain: none)."""
        return 0

    def checkpoint_entries(self) -> dict[str, Any]:
        """The layout keys of the saved stage-3 optimizer state, as DeepSpeed writes them."""
        return {"partition_count": self.shard_size, "mics_shard_size": -1}
