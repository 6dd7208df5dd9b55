"""dsrun.zero's argument handling (no ranks needed), and enable_sanity_checks' check in GatheredParameters (a world
of one)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dsrun
from dsrun.zero.partition_params import ParamStatus, partition_param
from dsrun.utils.errors import ConfigError


def test_register_external_parameter_rejects_a_plain_tensor() -> None:
    with pytest.raises(RuntimeError, match="torch.nn.Parameter"):
        dsrun.zero.register_external_parameter(nn.Linear(2, 2), torch.zeros(2))


def test_gathered_parameters_ignores_ordinary_tensors_and_can_be_disabled() -> None:
    lin = nn.Linear(2, 2)
    with dsrun.zero.GatheredParameters(lin.parameters(), modifier_rank=0):
        assert lin.weight.shape == (2, 2)  # not partitioned: untouched, no collective
    partition_param(lin.weight)
    with dsrun.zero.GatheredParameters(lin.weight, enabled=False):
        assert lin.weight.numel() == 0
    with dsrun.zero.GatheredParameters([lin.weight, lin.bias, torch.ones(1)]):
        assert lin.weight.ds_status is ParamStatus.AVAILABLE
    assert lin.weight.ds_status is ParamStatus.NOT_AVAILABLE


@pytest.mark.parametrize("kwargs, key", [({"pin_memory": True}, "pin_memory"),
                                         ({"remote_device": "gpu9"}, "remote_device"),
                                         ({"remote_device": "nvme"}, "remote_device"),
                                         ({"config_dict_or_path": "/no/such/ds.json"}, "config_dict_or_path")])
def test_init_rejects_bad_arguments_with_the_argument_named(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        dsrun.zero.Init(**kwargs)


def test_disabled_init_builds_an_ordinary_model() -> None:
    with dsrun.zero.Init(enabled=False):
        lin = nn.Linear(3, 3)
    assert lin.weight.shape == (3, 3) and not dsrun.zero.is_zero_param(lin.weight)


def test_init_context_leaves_torch_as_it_found_it() -> None:
    import dsrun.zero.init as zero_init

    before = {name: getattr(torch.nn.init, name) for name in zero_init._INIT_FUNCTIONS}
    linear_init, module_apply = nn.Linear.__init__, nn.Module.apply
    zero_init._install(override_module_apply=True)
    try:
        assert nn.Linear.__init__ is not linear_init
        assert nn.Module.apply is not module_apply  # zero_optimization.override_module_apply: gathers around fn

        class Defined(nn.Module):  # a class defined while the context is active is wrapped too
            def __init__(self) -> None:
                super().__init__()

        assert hasattr(Defined.__init__, "_ds_original")
    finally:
        zero_init._uninstall()
    assert nn.Linear.__init__ is linear_init and not hasattr(Defined.__init__, "_ds_original")
    assert nn.Module.apply is module_apply
    assert {name: getattr(torch.nn.init, name) for name in zero_init._INIT_FUNCTIONS} == before
    assert "__init_subclass__" not in nn.Module.__dict__


@pytest.mark.usefixtures("world_of_one")
def test_enable_sanity_checks_refuses_a_change_gathered_parameters_would_lose() -> None:
    """zero_optimization.enable_sanity_checks: an in-place change inside GatheredParameters(modifier_rank=None),
    which ranks would not share, raises (DeepSpeed's check); reading, or changing with a modifier_rank, does not."""
    for checks in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                  "zero_optimization": {"stage": 3, "enable_sanity_checks": checks,
                                        "stage3_param_persistence_threshold": 0,
                                        # partitioned even in a world of one (else kept whole: nothing to lose)
                                        "offload_param": {"device": "cpu"}}}
        dsrun.initialize(model=model, config=config)
        with dsrun.zero.GatheredParameters(model.weight):
            assert model.weight.sum() is not None  # a read
        with dsrun.zero.GatheredParameters(model.weight, modifier_rank=0), torch.no_grad():
            model.weight.add_(1.0)  # kept: rank 0's values are broadcast
        changed = []
        try:
            with dsrun.zero.GatheredParameters(model.weight), torch.no_grad():
                model.weight.add_(1.0)
        except RuntimeError as err:
            changed.append(str(err))
        assert bool(changed) is checks and all("modifier_rank=None" in e for e in changed)
        assert model.weight.ds_status is ParamStatus.NOT_AVAILABLE  # released either way
