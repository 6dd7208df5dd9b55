"""``zero.Init`` overrides torch's tensor constructors as DeepSpeed's does (device and floating dtype of the tensors
a model makes while it is built), and obeys a constructor wrapper replaced in DeepSpeed's ``partition_parameters``
module, as Hugging Face's ``prevent_arange_dtype_change`` replaces it (one rank, no launch)."""
from __future__ import annotations

import pytest
import torch

import dsrun
import dsrun.zero.init as partition_parameters
from dsrun.alias.paths import target_of
from dsrun.zero import tensor_creation

pytestmark = pytest.mark.usefixtures("world_of_one")  # zero.Init needs a process group

BF16_STAGE3 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


def _torch_is_as_it_was() -> bool:
    return ("__new__" not in vars(torch.Tensor) and torch.Tensor(2).dtype is torch.float32
            and all(getattr(torch, name) is original for name, original in tensor_creation.ORIGINALS.items()))


def test_this_module_is_deepspeeds_partition_parameters() -> None:
    assert target_of("deepspeed.runtime.zero.partition_parameters") == partition_parameters.__name__
    assert partition_parameters._orig_torch_arange is torch.arange
    assert partition_parameters.Init is dsrun.zero.Init
    assert partition_parameters.GatheredParameters is dsrun.zero.GatheredParameters


def test_floating_tensors_made_inside_take_the_context_dtype_and_torch_is_restored() -> None:
    with dsrun.zero.Init(config_dict_or_path=BF16_STAGE3):
        assert torch.zeros(2).dtype is torch.bfloat16 and torch.randn(2, 2).dtype is torch.bfloat16
        assert torch.tensor([1.5]).dtype is torch.bfloat16
        assert torch.ones(3, dtype=torch.float32).dtype is torch.bfloat16  # DeepSpeed casts even an explicit dtype
        assert torch.arange(4).dtype is torch.int64 and torch.full((2,), 7).dtype is torch.int64  # not floating
        legacy = torch.Tensor(2, 3)
        assert legacy.shape == (2, 3) and legacy.dtype is torch.bfloat16
        assert torch.empty(1).device == torch.device("cpu")  # the accelerator's device, on this machine the host
        buffers = torch.nn.Module()
        buffers.register_buffer("steps", torch.arange(0, 3, dtype=torch.float32))
    assert buffers.steps.dtype is torch.bfloat16
    assert _torch_is_as_it_was()


def test_without_a_dtype_or_overrides_tensors_keep_their_dtype() -> None:
    with dsrun.zero.Init():  # no config: dsrun keeps each tensor's dtype
        assert torch.zeros(2).dtype is torch.float32
    with dsrun.zero.Init(config_dict_or_path=BF16_STAGE3, tensor_overrides=[]):
        assert torch.zeros(2).dtype is torch.float32 and torch.zeros(2).zero_().dtype is torch.float32
    with dsrun.zero.Init(config_dict_or_path=BF16_STAGE3,
                         tensor_overrides=[tensor_creation.DeepSpeedTensorOverride.device]):
        assert torch.zeros(2).dtype is torch.float32
    assert _torch_is_as_it_was()


def test_a_wrapper_replaced_in_the_module_is_used_on_entry() -> None:
    """Hugging Face keeps ``torch.arange``'s dtype (RoPE buffers) by replacing the module's wrapper around the build."""
    original = partition_parameters.zero_wrapper_for_fp_tensor_constructor
    seen: list[object] = []

    def keep_arange_dtype(fn, *args, **kwargs):
        seen.append(kwargs["target_device"])
        if fn is partition_parameters._orig_torch_arange:
            return fn
        return original(fn, *args, **kwargs)

    partition_parameters.zero_wrapper_for_fp_tensor_constructor = keep_arange_dtype
    try:
        with dsrun.zero.Init(config_dict_or_path=BF16_STAGE3):
            assert torch.arange(0, 4, dtype=torch.float32).dtype is torch.float32
            assert torch.zeros(2).dtype is torch.bfloat16
    finally:
        partition_parameters.zero_wrapper_for_fp_tensor_constructor = original
    assert len(seen) == len(tensor_creation.ORIGINALS) and seen[0] == torch.device("cpu")
    assert _torch_is_as_it_was()


def test_nested_contexts_keep_the_outer_overrides_until_the_outer_exits() -> None:
    with dsrun.zero.Init(config_dict_or_path=BF16_STAGE3):
        with dsrun.zero.Init(config_dict_or_path={"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}}):
            assert torch.zeros(1).dtype is torch.bfloat16
        assert torch.zeros(1).dtype is torch.bfloat16
    assert _torch_is_as_it_was()
