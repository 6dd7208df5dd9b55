"""ZeRO++, MiCS and hpZ as a feature of the engine (:mod:`dsrun.features`): the sharding policy it supplies to the
stage-3 strategy (:mod:`dsrun.zero.sharding`).

Built when the config is at stage 3 and sets one of the keys below (at stages 0-2 they are notes of the
config check and nothing is built). The feature keeps the run's process groups (``take_topology``; MiCS's and
hpZ's groups are sub-groups of the data axis, created on request like MoE's expert groups, so it asks for no
axis of its own) and, when the engine builds its stage-3 strategy, hands it a :class:`ZeroPlusPlusSharding`
(``sharding_policy``), whose groups it then creates collectively from those process groups:

* **MiCS** (``mics_shard_size`` S): parameters, gradients and optimizer state are partitioned over *shard
  groups* of S consecutive data-parallel ranks (:meth:`dsrun.comm.ProcessGroups.shard`) and replicated across
  the D/S groups. A gather runs inside the shard group; a gradient is reduce-scattered inside it (every
  micro-step, as at plain stage 3) and the accumulated shard gradient is then all-reduced across the *replica
  group* (the ranks holding the same shard, :meth:`~dsrun.comm.ProcessGroups.shard_replicas`) once per
  optimizer step. Each rank holds psi/S of the parameters instead of psi/D.
  ``mics_hierarchical_params_gather``: a shard group spanning nodes gathers inside each node first and then
  across nodes (:func:`dsrun.comm.all_gather_hierarchical` over
  :meth:`~dsrun.comm.ProcessGroups.shard_node_groups`); the node size is ``LOCAL_WORLD_SIZE``.
* **hpZ** (``zero_hpz_partition_size`` H): parameters stay partitioned over the data-parallel group, but every
  forward gather also leaves each rank a *secondary* partition of the full value over a group of H
  consecutive ranks (psi/H elements per rank). Backward gathers read that one, so they run inside the H-rank
  group (a node) only. The secondary copy is stale after each optimizer step (or any write to the shard)
  until the next forward gather refreshes it.
* **qwZ** (``zero_quantized_weights``) gathers parameters as INT8 blocks with per-block scales
  (:mod:`dsrun.comm.quantized`); ``zero_quantized_nontrainable_weights`` does so for frozen parameters and
  keeps their shards as INT8 blocks and scales (:mod:`.quantized_shards`, gathered as they are; not when
  ``offload_param`` holds them). Parameters kept fp32 (``data_types.keep_in_fp32_modules``) gather exactly.
* **qgZ** (``zero_quantized_gradients``) replaces the reduce-scatter over the shard group with the
  hierarchical INT4 all-to-all (synchronous: ``overlap_comm`` does not overlap it), whose node and cross-node
  groups come from the same process groups; ``zeropp_loco_param`` adds LoCo's error feedback to it
  (:class:`dsrun.comm.quantized.LocoFeedback`: each bucket's quantization error is carried to its next step).
  The fp32-kept parameters' gradients reduce-scatter exactly (the stage-3 strategy leaves them out of qgZ).

The saved optimizer state keeps DeepSpeed's layout keys (``partition_count``, ``mics_shard_size``).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from dsrun import comm
from dsrun.comm import quantized
from dsrun.comm.comm import ProcessGroup
from dsrun.comm.groups import ProcessGroups, expert_parallel_size_of
from dsrun.config import DSConfig
from dsrun.config.zero import ZeroConfig, shard_size_problem
from dsrun.features import Feature
from dsrun.precision.keep_fp32 import is_kept
from dsrun.utils.errors import ConfigError, Problem

from dsrun.zero import quantized_shards
from dsrun.zero.partition_params import partition_numel
from dsrun.zero.sharding import ReduceScatter, ShardingPolicy

ZP = "zero_optimization"


def zeropp_keys_on(zero: ZeroConfig) -> bool:
    """Whether a stage-3 config sets a key of this feature's (MiCS, hpZ, qwZ, qgZ)."""
    return (int(zero.mics_shard_size) > 0 or int(zero.zero_hpz_partition_size) > 1 or bool(zero.zero_quantized_weights)
            or bool(zero.zero_quantized_nontrainable_weights) or bool(zero.zero_quantized_gradients))


class ZeroPlusPlusFeature(Feature):
    """Supplies :class:`ZeroPlusPlusSharding` to the stage-3 strategy."""

    name = "zeropp"

    def __init__(self, zero: ZeroConfig):
        self.zero = zero
        self._groups: ProcessGroups | None = None

    @classmethod
    def build(cls, config: DSConfig) -> "ZeroPlusPlusFeature | None":
        zero = config.zero_optimization
        return cls(zero) if int(zero.stage) == 3 and zeropp_keys_on(zero) else None

    def take_topology(self, model: nn.Module, groups: ProcessGroups) -> None:  # type: ignore[override]
        self._groups = groups

    def sharding_policy(self) -> "ZeroPlusPlusSharding":
        """The policy for the strategy being built (collective: it creates its shard groups)."""
        if self._groups is None:
            raise RuntimeError("the ZeRO++ feature was asked for its sharding before the engine built its groups")
        return ZeroPlusPlusSharding(self._groups, self._groups.data, self.zero)


class ZeroPlusPlusSharding(ShardingPolicy):
    """MiCS shard and replica groups, the hierarchical gather, hpZ secondary partitions, qwZ and qgZ over
    ``groups`` (built collectively: every rank the same sizes, in the same order)."""

    def __init__(self, groups: ProcessGroups, data_group: ProcessGroup, zero: ZeroConfig,
                 ranks_per_node: int | None = None):
        super().__init__(groups, data_group)
        self.zero = zero
        shard_size, hpz_size = int(zero.mics_shard_size), int(zero.zero_hpz_partition_size)
        dp = comm.get_world_size(data_group)
        self.mics = shard_size > 0 and shard_size != dp
        self.hpz = hpz_size > 1 and hpz_size != dp
        if shard_size > 0:
            _check_divides(f"{ZP}.mics_shard_size", shard_size, dp)
        if hpz_size > 1:
            _check_divides(f"{ZP}.zero_hpz_partition_size", hpz_size, dp)
        if self.mics and self.hpz:
            raise ConfigError(Problem(f"{ZP}.zero_hpz_partition_size",
                                      "hpZ and MiCS (mics_shard_size) cannot be combined",
                                      "use one: MiCS shards within groups, hpZ keeps a secondary partition"))
        hierarchical = bool(zero.mics_hierarchical_params_gather) and shard_size > 0
        self.shard_group = groups.shard(shard_size) if self.mics else data_group
        self.shard_size = shard_size if self.mics else dp
        self.replica_group = groups.shard_replicas(shard_size) if self.mics else None
        self.replicas = dp // self.shard_size
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
        self.secondary_size = hpz_size if self.hpz else 1
        self._qgz: quantized.QuantizedReduceScatter | None = None

    def group_of(self, param: nn.Parameter) -> ProcessGroup:
        if expert_parallel_size_of(param) is not None and (self.mics or self.hpz):
            raise ConfigError(Problem(f"{ZP}.mics_shard_size" if self.mics else f"{ZP}.zero_hpz_partition_size",
                                      "MiCS and hpZ do not partition MoE expert parameters",
                                      "turn them off for a model with experts"))
        return super().group_of(param)

    def attach(self, param: nn.Parameter) -> None:
        """The gather plan: hierarchical levels (MiCS) or a secondary partition (hpZ)."""
        super().attach(param)
        if expert_parallel_size_of(param) is not None or not self.hpz:
            return
        param.ds_secondary_group = self.secondary_group
        param.ds_secondary_world_size = self.secondary_size
        param.ds_secondary_rank = comm.get_rank(self.secondary_group)
        param.ds_secondary_tensor = torch.zeros(partition_numel(param.ds_numel, self.secondary_size),
                                                dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)
        param.ds_secondary_valid = False

    def prepare(self, params: list[nn.Parameter]) -> None:
        """Mark the parameters whose gathers are quantized (qwZ: all; nontrainable: the frozen ones, whose
        shards are then kept quantized too, unless ``offload_param`` holds them; neither: the fp32-kept); build
        qgZ's quantized reduce-scatter over the shard group (collective: it may create node groups)."""
        zero = self.zero
        keep_frozen = zero.zero_quantized_nontrainable_weights and zero.offload_param.device == "none"
        for p in params:
            frozen = zero.zero_quantized_nontrainable_weights and not p.requires_grad
            # keep_in_fp32_modules: a kept parameter is gathered (and stored) exactly, in fp32
            if (zero.zero_quantized_weights or frozen) and p.ds_tensor.is_floating_point() and not is_kept(p):
                p.ds_quantized_gather = quantized.WEIGHT_BLOCK
                if frozen and keep_frozen:
                    quantized_shards.store_quantized(p, quantized.WEIGHT_BLOCK)
        if zero.zero_quantized_gradients:
            loco = zero.zeropp_loco_param
            feedback = None if loco is None else quantized.LocoFeedback(**loco)  # checked by config.rules
            self._qgz = quantized.make_reduce_scatter(self.shard_group, groups=self.groups, loco=feedback)

    def reduce_scatter_for(self, group: ProcessGroup) -> ReduceScatter | None:
        return self._qgz if self._qgz is not None and group is self._qgz.group else None

    def check_gradient_stores(self, resident: bool) -> None:
        if self.mics and not resident:
            raise ConfigError(Problem(f"{ZP}.mics_shard_size", "MiCS cannot reduce gradients kept in "
                                      "NVMe swap files (offload_optimizer.device nvme)", "offload to cpu instead"))

    def after_boundary_reduction(self, grads: list[torch.Tensor]) -> None:
        """MiCS: each shard group summed its own ranks' gradients; sum the shard gradients over the replica
        group to add the other groups'."""
        if not self.mics or self.replicas == 1:
            return
        for g in grads:
            comm.all_reduce(g, group=self.replica_group)

    def secondary_bytes(self, params: list[nn.Parameter]) -> int:
        """Bytes of the hpZ secondary partitions this rank holds."""
        return sum(p.ds_secondary_tensor.numel() * p.ds_secondary_tensor.element_size() for p in params
                   if getattr(p, "ds_secondary_tensor", None) is not None)

    def checkpoint_entries(self) -> dict[str, Any]:
        return {"partition_count": self.shard_size, "mics_shard_size": self.shard_size if self.mics else -1}


def _check_divides(key: str, size: int, dp: int) -> None:
    problem = shard_size_problem(key, size, dp)  # the rule config --validate runs too
    if problem is not None:
        raise ConfigError(problem)
