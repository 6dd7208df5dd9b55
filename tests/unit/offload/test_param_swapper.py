"""Parameter offload (``offload_param``) in one process: clear errors, the bounded pool, write-back, Init."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.offload.param_swapper import NvmeParamOffload, is_swapped, shard_value
from dsrun.zero.partition_params import partition_param
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _config(offload: dict, stage: int = 3) -> dict:
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "offload_param": offload},
            "steps_per_print": 1000}


def _nvme(tmp_path, **extra) -> dict:
    return {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4, "buffer_size": 1000, **extra}


@pytest.mark.parametrize("offload, stage, key, says", [
    ({"device": "cpu"}, 2, "offload_param.device", "needs ZeRO stage 3"),
    ({"device": "nvme"}, 3, "offload_param.nvme_path", "required"),
    ({"buffer_size": 100}, 3, "offload_param.buffer_size", "at least 512"),  # the 32x16 weight: 512 per rank
    ({"buffer_count": 1}, 3, "offload_param.buffer_count", "at least 2"),  # a Linear gathers weight and bias
])
def test_bad_offload_param_settings_fail_with_the_key_named(tmp_path, offload, stage, key, says) -> None:
    section = offload if offload.get("device") else _nvme(tmp_path, **offload)
    with pytest.raises(ConfigError) as info:
        dsrun.initialize(model=_model(), config=_config(section, stage))
    assert key in str(info.value) and says in str(info.value)
    assert "\n" not in str(info.value).strip() or len(info.value.problems) == 1  # one line per problem


def test_zero_init_nvme_needs_an_nvme_path_in_the_config() -> None:
    with pytest.raises(ConfigError, match="nvme_path"):
        dsrun.zero.Init(remote_device="nvme", config_dict_or_path={"zero_optimization": {"stage": 3}})


def test_pool_never_exceeds_buffer_count_and_write_back_round_trips(tmp_path) -> None:
    offload = NvmeParamOffload(str(tmp_path), torch.device("cpu"), buffer_count=2, buffer_size=64, max_in_cpu=0)
    params = []
    for i in range(5):
        p = torch.nn.Parameter(torch.full((8, 8), float(i)))
        partition_param(p)
        offload.adopt(p)
        params.append(p)
    assert all(is_swapped(p) and p.ds_tensor.numel() == 0 for p in params)
    offload.after_fetch(params)  # read ahead as far as the pool allows
    assert offload.stats()["buffers"] <= 2
    for i, p in enumerate(params):
        assert torch.equal(offload.gather_input(p), torch.full((64,), float(i)))
    offload.write_range(params[3], 0, 10, torch.full((10,), 7.0))  # a shard written in two parts
    offload.write_range(params[3], 10, 64, torch.full((54,), 8.0))
    offload.flush()
    value = shard_value(params[3])
    assert torch.equal(value[:10], torch.full((10,), 7.0)) and torch.equal(value[10:], torch.full((54,), 8.0))
    assert offload.stats()["buffers"] <= 2 and offload.stats()["read_ahead_hits"] >= 1
    folder = offload.folder
    offload.close()
    assert not folder.exists()


def test_zero_init_nvme_keeps_only_persistent_parameters_in_memory(tmp_path) -> None:
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                 "offload_param": _nvme(tmp_path)}}
    with dsrun.zero.Init(config_dict_or_path=cfg) as init:
        model = _model()
    weight, bias = model[0].weight, model[0].bias
    assert is_swapped(weight) and weight.ds_tensor.numel() == 0  # 512 elements: in a file
    assert not is_swapped(bias) and bias.ds_tensor.numel() == 32  # under the threshold: stays in memory
    with dsrun.zero.GatheredParameters(weight):
        assert weight.shape == (32, 16) and weight.abs().sum() > 0
    init.offload.close()
