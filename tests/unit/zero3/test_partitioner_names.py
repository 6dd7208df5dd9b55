"""DeepSpeed's ZeRO-3 partitioner names that its unit tests import (issue 43): ``partition_parameters``'
``MultipleAllGatherHandles``, ``get_allgather_dtype``, ``CUDAQuantizer``, ``_contradicting_single_rank_pg_error``,
``InsertPostInitMethodToModuleSubClasses.linear_bk``; ``zero.unwrap_model_for_generation``, ``ZeroParamStatus``;
``parameter_offload``'s ``ZeROOrderedDict``; ``leaf_module_config``'s defaults; ``linear.LinearModuleForZeroStage3``.
All in one process (a one-rank world where ``zero.Init`` needs one)."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.zero import partitioner_internals as internals
from dsrun.zero.hooks import ParameterCoordinator
from dsrun.zero.partition_params import ParamStatus, partition_param, start_gather, write_shard


def _deepspeed(path: str):
    from dsrun.alias.paths import target_of

    return importlib.import_module(target_of(path))


def test_names_at_deepspeeds_paths():
    partition_parameters = _deepspeed("deepspeed.runtime.zero.partition_parameters")
    for name in ("MultipleAllGatherHandles", "get_allgather_dtype", "CUDAQuantizer", "partitioned_param_data_shape",
                 "_contradicting_single_rank_pg_error", "InsertPostInitMethodToModuleSubClasses"):
        assert getattr(partition_parameters, name) is getattr(internals, name)
    assert partition_parameters.zero3_linear_wrap is _deepspeed("deepspeed.runtime.zero.linear").zero3_linear_wrap
    zero = _deepspeed("deepspeed.runtime.zero")
    assert zero.ZeroParamStatus is ParamStatus and callable(zero.unwrap_model_for_generation)
    assert issubclass(partition_parameters.Init, internals.InsertPostInitMethodToModuleSubClasses)
    p = partition_param(nn.Parameter(torch.ones(3, 2)))
    assert list(p.shape) == internals.partitioned_param_data_shape  # [0]: the placeholder's shape


def test_single_rank_group_under_a_multi_process_launcher_is_an_error(world_of_one, monkeypatch):
    error = internals._contradicting_single_rank_pg_error
    message = error(dp_world_size=1, explicit_process_group=None, env={"WORLD_SIZE": "8"})
    assert "WORLD_SIZE=8" in message and "init_distributed" in message
    for env in ({"WORLD_SIZE": "1"}, {}, {"WORLD_SIZE": ""}, {"WORLD_SIZE": "x"}, {"WORLD_SIZE": None}):
        assert error(dp_world_size=1, explicit_process_group=None, env=env) is None
    assert error(dp_world_size=8, explicit_process_group=None, env={"WORLD_SIZE": "8"}) is None
    assert error(dp_world_size=1, explicit_process_group=object(), env={"WORLD_SIZE": "8"}) is None
    from dsrun.zero import Init

    monkeypatch.setenv("WORLD_SIZE", "4")  # the launcher's word; this process's world has one rank
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4"):
        Init(module=nn.Linear(2, 2))


def test_multiple_handles_pass_the_dependency_flag_by_keyword():
    class KeywordOnly:
        def wait(self, *, handle_dependency=True):
            self.flag = handle_dependency

    param = partition_param(nn.Parameter(torch.arange(6.0)))
    gather = start_gather(param, async_op=True)  # dsrun's own handle takes the keyword too
    handles = [KeywordOnly(), gather]
    internals.MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert handles[0].flag is False
    assert param.ds_status is ParamStatus.AVAILABLE and torch.equal(param.data, torch.arange(6.0))


def test_allgather_dtype_is_the_autocast_comm_dtype_else_the_shards():
    param = partition_param(nn.Parameter(torch.ones(4)))
    assert internals.get_allgather_dtype(param, param.ds_tensor) == torch.float32
    param.comm_dtype = torch.bfloat16  # torch_autocast marks a lower-precision-safe module's parameters so
    assert internals.get_allgather_dtype(param, param.ds_tensor) == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantizer_round_trips_in_the_parameters_dtype(dtype):
    torch.manual_seed(0)
    param = torch.randn(4096, dtype=dtype)
    quantizer = internals.CUDAQuantizer()
    codes, scales = quantizer.quantize(param)
    assert codes.dtype == torch.int8 and scales.numel() == quantizer.group_size_cache[4096] == 1
    back = quantizer.dequantize(codes, scales, dtype=param.dtype)
    assert back.dtype == dtype
    # symmetric INT8: every value within half a step (scale / 2), plus the fp16 the kernel computes in
    assert (back.float() - param.float()).abs().max() <= scales.max() / 2 + 1e-2
    with pytest.raises(ValueError, match="multiple of 8"):
        quantizer.quantize(torch.ones(12))


def test_memory_efficient_linear_records_what_it_replaced_once(world_of_one, monkeypatch):
    from dsrun.zero import Init
    from dsrun.zero.linear import zero3_linear_wrap

    base = internals.InsertPostInitMethodToModuleSubClasses
    original = F.linear
    monkeypatch.setattr(F, "linear", original)  # restored after the test, whatever it installs
    if "linear_bk" in vars(base):
        monkeypatch.delattr(base, "linear_bk")
    off = {"zero_optimization": {"stage": 3, "memory_efficient_linear": False}}
    with Init(config_dict_or_path=off):
        assert F.linear is original and "linear_bk" not in vars(base)
    init = Init(config_dict_or_path={"zero_optimization": {"stage": 3}})
    assert F.linear is original  # building the context changes nothing; entering it does
    with init:
        assert F.linear is zero3_linear_wrap and base.linear_bk is original
    assert F.linear is zero3_linear_wrap  # for the rest of the process, as in DeepSpeed

    def quantized_linear(*args):  # a wrapper someone put over ZeRO-3's linear since
        return zero3_linear_wrap(*args)

    monkeypatch.setattr(F, "linear", quantized_linear)
    Init(module=nn.Linear(2, 2))
    assert F.linear is quantized_linear and base.linear_bk is original
    monkeypatch.setattr(F, "linear", original)  # the user put torch's back: installed again
    Init(module=nn.Linear(2, 2))
    assert F.linear is zero3_linear_wrap


def test_linear_module_for_zero_stage3_is_a_linear():
    linear = _deepspeed("deepspeed.runtime.zero.linear")
    torch.manual_seed(0)
    layer = linear.LinearModuleForZeroStage3(4, 3)
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
    assert isinstance(layer, nn.Linear) and linear.zero3_linear_wrap is linear.zero3_linear


def _partitioned_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    for p in model.parameters():
        partition_param(p)
    return model


def test_unwrap_for_generation_gathers_everything_and_lifts_the_hooks():
    from dsrun.zero import GatheredParameters, unwrap_model_for_generation

    model = _partitioned_model()
    coordinator = ParameterCoordinator(model)
    engine = SimpleNamespace(module=model, strategy=SimpleNamespace(coordinator=coordinator))
    x = torch.randn(3, 4)
    coordinator.begin_forward()
    expected = model(x)
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine and not coordinator._hooks
        assert all(p.ds_status is ParamStatus.AVAILABLE for p in model.parameters())
        assert all(not isinstance(m._parameters, coordinator_dict()) for m in model.modules())
        torch.testing.assert_close(model(x), expected)
        torch.testing.assert_close(model(x), expected)  # no hook released anything between the two
        # an engine's pass boundaries inside the block (a forward, a gradient, backward's end) release nothing
        coordinator.begin_forward()
        coordinator.release_after_grad(model[0].weight)
        coordinator.end_backward()
        assert all(p.ds_status is ParamStatus.AVAILABLE for p in model.parameters())
        assert not coordinator.trace_complete  # the pass before the block (forward only) was not made the trace
        # an optimizer step inside (new shards, the gathered copies invalidated): gathered again, with the new values
        bias = model[2].bias.detach().clone()
        write_shard(model[2].bias, torch.zeros(2))
        coordinator.invalidate()
        assert torch.equal(model[2].bias, torch.zeros(2))
        torch.testing.assert_close(model(x), expected - bias)  # one fp32 rounding apart: the default tolerance
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())
    assert coordinator._hooks and not coordinator.trace  # hooked again; the next pass records its order anew
    coordinator.begin_forward()
    torch.testing.assert_close(model(x), expected - bias)  # the step's values, gathered by the hooks again
    whole = nn.Linear(2, 2)  # another stage's model: whole already, nothing to lift
    with unwrap_model_for_generation(SimpleNamespace(module=whole, strategy=None)):
        with GatheredParameters(list(whole.parameters())):
            assert whole.weight.numel() == 4


def coordinator_dict() -> type:
    return _deepspeed("deepspeed.runtime.zero.parameter_offload").ZeROOrderedDict


def test_zero_ordered_dict_is_the_coordinators_gathering_dict():
    parameter_offload = _deepspeed("deepspeed.runtime.zero.parameter_offload")
    ZeROOrderedDict, ensure = parameter_offload.ZeROOrderedDict, parameter_offload.ensure_zero_ordered_dict
    model = _partitioned_model()
    ParameterCoordinator(model)
    assert isinstance(model[0]._parameters, ZeROOrderedDict) and model[0]._parameters._parent_module is model[0]
    m = nn.Linear(4, 4, bias=False)
    m._parameters = plain = dict(m._parameters)  # torch >= 2.5's plain dict
    ensure(m)
    assert isinstance(m._parameters, ZeROOrderedDict) and "weight" in m._parameters
    assert m._original_parameters is plain is not m._parameters
    wrapped = m._parameters
    ensure(m)
    assert m._parameters is wrapped  # idempotent
    m._original_parameters = first = {"kept": None}
    m._parameters = dict(wrapped)
    ensure(m)
    assert m._original_parameters is first  # the first-saved original is never overwritten
    bare = SimpleNamespace(_parameters=None)
    ensure(bare)
    ensure(SimpleNamespace())
    assert bare._parameters is None


def test_leaf_module_section_defaults_to_deepspeeds_classes_and_reads_a_string_as_one_name():
    config = _deepspeed("deepspeed.runtime.zero.leaf_module_config")
    from dsrun.config.zero import ZeroConfig

    assert config.DEFAULT_LEAF_MODULE_CLASSES == [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]
    assert ZeroConfig().leaf_module.classes == config.DEFAULT_LEAF_MODULE_CLASSES
    assert ZeroConfig().leaf_module.names == ZeroConfig().leaf_module.name_suffixes == []
    section = ZeroConfig(leaf_module={"classes": "my.Class", "names": ["a", "b", "a"], "name_suffixes": "tail"})
    assert (section.leaf_module.classes, section.leaf_module.names) == (["my.Class"], ["a", "b"])
    assert section.leaf_module.name_suffixes == ["tail"]
    assert config.DeepSpeedZeroLeafModuleConfig is type(section.leaf_module)
