"""``sequence_parallel_size``: the batch triad counts world / sequence_parallel_size data-parallel replicas
(a sequence group of ranks shares its samples), and a size that does not divide the world is refused."""
from __future__ import annotations

import pytest

from dsrun.config import load_ds_config
from dsrun.utils.errors import ConfigError


def test_batch_counts_world_over_sequence_parallel_size():
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    plain = load_ds_config(base, world_size=8)
    sharded = load_ds_config({**base, "sequence_parallel_size": 4}, world_size=8)
    assert plain.train_batch_size == 2 * 3 * 8
    assert sharded.train_batch_size == 2 * 3 * (8 // 4)
    assert "sequence_parallel_size 4" in sharded.world_size_source
    # the other direction: a global batch of 12 on 8 ranks with sp 4 is 2 replicas x 2 micro x 3 steps
    assert load_ds_config({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 4},
                          world_size=8).gradient_accumulation_steps == 3


def test_size_not_dividing_the_world_is_refused():
    with pytest.raises(ConfigError, match="sequence_parallel_size: 3 does not divide the data-parallel world size 8"):
        load_ds_config({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 3}, world_size=8)


def test_data_parallel_size_is_the_replica_count_of_the_mesh():
    mesh = {"train_batch_size": 8, "data_parallel_size": 2, "sequence_parallel_size": 2}
    assert load_ds_config(mesh, world_size=4).train_micro_batch_size_per_gpu == 4  # 2 replicas of 2 ranks
    with pytest.raises(ConfigError, match=r"data_parallel_size: is 3, but the world holds 2 data-parallel replicas"):
        load_ds_config({**mesh, "data_parallel_size": 3}, world_size=4)


def test_mesh_param_is_the_config_keys_given_once():
    from dsrun.engine.initialize import _mesh_config

    assert _mesh_config({"train_batch_size": 8}, (2, 2)) == {"train_batch_size": 8, "data_parallel_size": 2,
                                                             "sequence_parallel_size": 2}
    with pytest.raises(ConfigError, match="sequence_parallel_size: is 4, but mesh_param sets 2"):
        _mesh_config({"sequence_parallel_size": 4}, (2, 2))
    with pytest.raises(ConfigError, match=r"initialize\(mesh_param=...\): needs the config as a dict"):
        _mesh_config("ds_config.json", (2, 2))
