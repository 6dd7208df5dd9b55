"""The stage-3 sharding seam: the strategy partitions, reduces and saves as the sharding policy a feature supplies
(``Feature.sharding_policy``, handed over as ``StrategyContext.sharding``), plain ZeRO-3's when none does; ZeRO++,
MiCS and hpZ attach only through it (dsrun/zero/zeropp.py). The groups come from the run's ProcessGroups."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun import comm
from dsrun.comm.groups import ProcessGroups, current_groups, set_current_groups
from dsrun.comm.topology import PipeModelDataParallelTopology
from dsrun.config import load_ds_config
from dsrun.config.zero import ZeroConfig
from dsrun.features import Feature, Features, register_feature, unregister_feature
from dsrun.utils.errors import ConfigError
from dsrun.zero.sharding import ShardingPolicy
from dsrun.zero.zeropp import ZeroPlusPlusFeature, ZeroPlusPlusSharding
from tests.unit.runtime.conftest import world_of_one  # the fixture

__all__ = ["world_of_one"]


def _config(stage: int = 3, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


class ToyPolicy(ShardingPolicy):
    """Partitions over a group of its own, counts the boundary reductions and saves its own layout count."""

    def __init__(self, groups, data_group):
        super().__init__(groups, data_group)
        self.shard_group = comm.new_group([comm.get_rank()], local=True)
        self.boundaries = 0

    def after_boundary_reduction(self, grads):
        self.boundaries += 1

    def checkpoint_entries(self):
        return {"partition_count": self.shard_size, "mics_shard_size": 7}


class ToyShardingFeature(Feature):
    name = "toy_sharding"
    policies: list = []

    @classmethod
    def build(cls, config):
        return cls()

    def take_topology(self, model, groups):
        self.groups = groups

    def sharding_policy(self):
        policy = ToyPolicy(self.groups, self.groups.data)
        ToyShardingFeature.policies.append(policy)
        return policy


@pytest.fixture
def toy_sharding():
    ToyShardingFeature.policies = []
    register_feature(ToyShardingFeature)
    try:
        yield
    finally:
        unregister_feature(ToyShardingFeature)


def _step(engine) -> None:
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()


@pytest.mark.usefixtures("world_of_one")
def test_the_strategy_partitions_reduces_and_saves_as_a_supplied_policy(toy_sharding):
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 3), config=_config())
    policy = ToyShardingFeature.policies[-1]
    assert engine.strategy.sharding is policy
    assert policy.shard_group is not None and policy.shard_group is not engine.groups.data
    assert all(p.ds_process_group is policy.shard_group for p in engine.module.parameters())
    assert engine.strategy.norm_group is policy.shard_group
    _step(engine)
    _step(engine)
    assert policy.boundaries == 2  # once per optimizer step
    state = engine.strategy.state_dict()
    assert (state["partition_count"], state["mics_shard_size"]) == (1, 7)
    assert list(state)[:3] == ["zero_stage", "partition_count", "mics_shard_size"]  # DeepSpeed's key order
    engine.destroy()


@pytest.mark.usefixtures("world_of_one")
def test_without_zeropp_keys_the_feature_is_absent_and_the_policy_plain():
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 3), config=_config())
    assert engine.features.get(ZeroPlusPlusFeature) is None
    assert type(engine.strategy.sharding) is ShardingPolicy
    assert all(p.ds_process_group is engine.groups.data for p in engine.module.parameters())
    state = engine.strategy.state_dict()
    assert (state["partition_count"], state["mics_shard_size"]) == (1, -1)
    engine.destroy()


@pytest.mark.usefixtures("world_of_one")
def test_zeropp_keys_attach_the_feature_whose_policy_quantizes_the_gathers():
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 3), config=_config(zero_quantized_weights=True))
    feature = engine.features.get(ZeroPlusPlusFeature)
    assert feature is not None
    assert isinstance(engine.strategy.sharding, ZeroPlusPlusSharding)
    assert all(p.ds_quantized_gather for p in engine.module.parameters())
    engine.destroy()


def test_the_feature_is_built_only_at_stage_3_with_one_of_its_keys():
    def built(stage: int, **zero) -> bool:
        return ZeroPlusPlusFeature.build(load_ds_config(_config(stage, **zero), world_size=4)) is not None

    assert not built(3)
    assert not built(3, zero_hpz_partition_size=1)  # 1: hpZ off
    assert not built(2, zero_quantized_gradients=True)  # stages 1-2: a note of the config check, nothing built
    assert not built(1, mics_shard_size=2)
    for keys in ({"mics_shard_size": 2}, {"zero_hpz_partition_size": 2}, {"zero_quantized_weights": True},
                 {"zero_quantized_nontrainable_weights": True}, {"zero_quantized_gradients": True}):
        assert built(3, **keys), keys


def test_two_features_supplying_a_policy_are_refused():
    class Supplies(Feature):
        name = "supplies"

        def sharding_policy(self):
            return object()

    assert Features([Feature()]).sharding_policy() is None
    with pytest.raises(ValueError, match="supplies, supplies each supply a stage-3 sharding policy"):
        Features([Supplies(), Supplies()]).sharding_policy()


def test_the_engine_s_groups_adopt_the_shard_groups_zero_init_made(monkeypatch):
    """MiCS_Init partitions over the run's shard groups; the engine's groups, made the run's, hand out the same
    ones (and leave them to their maker to destroy); groups that cut other data groups adopt nothing."""
    destroyed = []
    monkeypatch.setattr(comm, "destroy_process_group", destroyed.append)
    made = ProcessGroups(world_size=8, rank=0)  # a world of one data group: no torch group is created
    shard, replicas = object(), object()
    made._splits[("shard", 4, 0)] = (shard, replicas, [0, 1, 2, 3], [0, 4])
    previous = current_groups()
    try:
        set_current_groups(made)
        engine_groups = ProcessGroups(world_size=8, rank=0)
        set_current_groups(engine_groups)
        assert engine_groups.shard(4) is shard and engine_groups.shard_replicas(4) is replicas
        engine_groups.destroy()
        assert destroyed == []
    finally:
        set_current_groups(None)
        set_current_groups(previous)
    tensor_parallel = ProcessGroups.__new__(ProcessGroups)  # the rank lists only: no torch groups
    tensor_parallel.world_size, tensor_parallel._splits, tensor_parallel._adopted = 8, {}, set()
    tensor_parallel.topology = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=4)
    tensor_parallel.adopt_shard_groups(made)
    assert ("shard", 4, 0) not in tensor_parallel._splits


class FourRanks:
    """The shard groups a ZeRO++ policy asks for on a data group of 4 (named, not created)."""

    def shard(self, size):
        return f"shard{size}"

    def shard_replicas(self, size):
        return f"replicas{size}"

    def shard_node_groups(self, size, per_node):
        return f"node{size}/{per_node}", f"across{size}/{per_node}"


@pytest.fixture
def four_ranks(monkeypatch):
    monkeypatch.setattr(comm, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(comm, "get_rank", lambda group=None: 0)
    return FourRanks()


def _policy(groups, ranks_per_node=None, **zero) -> ZeroPlusPlusSharding:
    return ZeroPlusPlusSharding(groups, None, ZeroConfig(stage=3, **zero), ranks_per_node=ranks_per_node)


def test_the_zeropp_policy_cuts_its_groups_from_the_run_s_groups(four_ranks):
    mics = _policy(four_ranks, mics_shard_size=2)
    assert (mics.shard_group, mics.replica_group, mics.shard_size, mics.replicas) == ("shard2", "replicas2", 2, 2)
    assert mics.checkpoint_entries() == {"partition_count": 2, "mics_shard_size": 2}
    hier = _policy(four_ranks, ranks_per_node=2, mics_shard_size=4, mics_hierarchical_params_gather=True)
    assert hier.shard_group is None and hier.gather_levels == ("node4/2", "across4/2")  # the whole data group
    assert hier.checkpoint_entries() == {"partition_count": 4, "mics_shard_size": -1}
    hpz = _policy(four_ranks, zero_hpz_partition_size=2)
    assert (hpz.shard_group, hpz.secondary_group, hpz.secondary_size) == (None, "shard2", 2)
    assert hpz.checkpoint_entries() == {"partition_count": 4, "mics_shard_size": -1}


def test_the_zeropp_policy_refuses_what_it_cannot_do(four_ranks):
    with pytest.raises(ConfigError, match="cannot be combined"):
        _policy(four_ranks, mics_shard_size=2, zero_hpz_partition_size=2)
    with pytest.raises(ConfigError, match="must divide the data-parallel size 4"):
        _policy(four_ranks, mics_shard_size=3)
    with pytest.raises(ConfigError, match="do not split into nodes of 3"):
        _policy(four_ranks, ranks_per_node=3, mics_shard_size=4, mics_hierarchical_params_gather=True)
    mics = _policy(four_ranks, mics_shard_size=2)
    with pytest.raises(ConfigError, match="NVMe swap files"):
        mics.check_gradient_stores(resident=False)
    mics.check_gradient_stores(resident=True)
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    with pytest.raises(ConfigError, match="do not partition MoE expert parameters"):
        mics.group_of(expert)
    assert mics.group_of(torch.nn.Parameter(torch.zeros(2))) == "shard2"
