"""DeepSpeed's module paths that map onto dsrun's objects behave as DeepSpeed's do."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO


def test_deepspeed_config_resolves_the_batch_and_exposes_deepspeeds_flat_names():
    from dsrun import DeepSpeedConfig, DeepSpeedConfigError

    config = DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (8, 4, 2)
    assert config.zero_enabled and config.zero_optimization_stage == 2
    assert config.bfloat16_enabled and not config.fp16_enabled
    assert config.optimizer_name == "adamw" and config.optimizer_params == {"lr": 1e-3}
    assert config._param_dict["train_batch_size"] == 8
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage"):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 7}})
    with pytest.raises(DeepSpeedConfigError, match="Invalid gradient_allreduce_op: expected 'mean' or 'sum'"):
        DeepSpeedConfig({"train_batch_size": 8, "gradient_allreduce_op": "max"})
    # DeepSpeed's batch arithmetic again over the attributes as a caller left them (None: fill it in)
    config.world_size = 2
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = 32, 8, None
    config._configure_train_batch_size()
    assert config.gradient_accumulation_steps == 2
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = 32, 18, 1
    with pytest.raises(AssertionError, match="train_batch_size 32 != train_micro_batch_size_per_gpu 18"):
        config._configure_train_batch_size()


def test_set_random_seed_makes_every_generator_repeat():
    import random

    import numpy as np

    from dsrun.compat.runtime.utils import set_random_seed

    draws = []
    for _ in range(2):
        set_random_seed(1234)
        draws.append((random.random(), float(np.random.rand()), torch.rand(3).tolist()))
    assert draws[0] == draws[1]


def test_see_memory_usage_logs_only_when_forced():
    from dsrun.compat.runtime.utils import see_memory_usage
    from dsrun.utils.logging import logger

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    try:
        see_memory_usage("before", force=False)
        assert records == []
        see_memory_usage("after forward", force=True)
    finally:
        logger.removeHandler(handler)
    assert records[0] == "after forward" and any("CPU Virtual Memory" in line for line in records)


def test_convert_conv1d_to_linear_computes_the_same_function():
    from transformers.pytorch_utils import Conv1D

    from dsrun.compression.helper import convert_conv1d_to_linear, recursive_getattr

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(Conv1D(6, 4)), torch.nn.ReLU())
    x = torch.randn(3, 4)
    expected = model(x)
    convert_conv1d_to_linear(model, Conv1D)
    assert isinstance(recursive_getattr(model, "0.0"), torch.nn.Linear)
    # same products and sums, in a possibly different order: bound by the fp32 rounding of a 4-term dot product
    torch.testing.assert_close(model(x), expected, rtol=0, atol=8 * torch.finfo(torch.float32).eps * 4)


def test_fused_adam_matches_torch_adamw_and_sets_grads_to_none():
    from dsrun.ops.adam import FusedAdam

    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(16, dtype=torch.float64).float())
    ref = torch.nn.Parameter(ours.detach().double().clone())
    fused = FusedAdam([ours], lr=0.01, weight_decay=0.1)
    reference = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1)
    for step in range(3):
        grad = torch.randn(16, dtype=torch.float64)
        ours.grad, ref.grad = grad.float(), grad.clone()
        fused.step()
        reference.step()
    # a few fp32 roundings per step on values of order 1: far below the 0.01 lr steps being compared
    torch.testing.assert_close(ours.detach().double(), ref.detach(), rtol=0, atol=3 * 16 * torch.finfo(torch.float32).eps)
    fused.zero_grad()
    assert ours.grad is None


def test_on_device_builds_on_meta_in_the_given_dtype():
    from dsrun import OnDevice

    with OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(1024, 1024)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    with OnDevice(dtype=torch.bfloat16, enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32


def test_accelerator_has_deepspeeds_cpu_methods():
    from dsrun.accelerator import is_current_accelerator_supported
    from dsrun.accelerator.cpu_accelerator import CPU_Accelerator

    cpu = CPU_Accelerator()
    assert is_current_accelerator_supported()
    assert cpu.device_count() == 1 and cpu.current_device_name() == "cpu" and cpu.is_synchronized_device()
    assert torch.bfloat16 in cpu.supported_dtypes()
    cpu.manual_seed(7)
    state = cpu.get_rng_state()
    first = torch.rand(2)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(2), first)


def test_zero_module_paths_name_dsruns_objects():
    from dsrun.config.zero import ZeroConfig
    from dsrun.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from dsrun.zero.offload_config import OffloadDeviceEnum
    from dsrun.zero.init import ZeroParamStatus
    from dsrun.zero import ParamStatus

    assert issubclass(DeepSpeedZeroConfig, ZeroConfig) and ZeroParamStatus is ParamStatus
    config = DeepSpeedZeroConfig(stage=ZeroStageEnum.weights, offload_param={"device": OffloadDeviceEnum.cpu})
    assert config.stage == 3 and config.offload_param.device == "cpu" and config.offload_optimizer is None
    # DeepSpeed's constructor: deprecated keys migrated, its prefix-less attribute names
    legacy = DeepSpeedZeroConfig(cpu_offload=True, stage3_prefetch_bucket_size=123)
    assert legacy.offload_optimizer.device == "cpu" and legacy.prefetch_bucket_size == 123


def test_deepspeed_examples_inventory_count():
    """The kept list of deepspeed.* names DeepSpeedExamples uses: every one resolves (111 of 111 since
    2026-12-07; docs/deepspeed-alias.md, "Measured on real client code")."""
    result = subprocess.run([sys.executable, "benchmarks/deepspeed_names.py", "--quiet"], cwd=REPO, text=True,
                            capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    resolved, total = (int(word) for word in result.stdout.split()[1:4:2])
    assert (resolved, total) == (111, 111), result.stdout


def test_steps_per_print_inf_from_accelerate_means_never():
    """accelerate's DeepSpeed plugin writes ``steps_per_print: inf`` (never); it loads as the largest step count
    (an int the engine's ``global_steps % every`` never reaches), and finite values are kept."""
    import sys as _sys

    from dsrun.config import load_ds_config

    config = load_ds_config({"train_batch_size": 2, "steps_per_print": float("inf")})
    assert config.steps_per_print == _sys.maxsize
    assert load_ds_config({"train_batch_size": 2, "steps_per_print": 3}).steps_per_print == 3


def test_deepspeed_runner_functions_keep_deepspeeds_shapes_and_errors():
    from dsrun.cli import deepspeed_runner as runner

    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert runner.parse_resource_filter(hosts, exclude_str="worker-0:0,1@worker-1:3") == {
        "worker-0": [2, 3], "worker-1": [0, 1, 2]}
    assert runner.parse_resource_filter({"worker-0": [0, 1]}, exclude_str="worker-0") == {}
    with pytest.raises(ValueError, match="jeff"):
        runner.parse_resource_filter(hosts, include_str="jeff")
    assert runner._parse_hostfile(["worker-1 slots=2", "", "# c", "localhost slots=1"]) == {
        "worker-1": 2, "localhost": 1}
    with pytest.raises(ValueError):
        runner.main(["--num_nodes", "1", "-i", "localhost", "foo.py"])
    import base64
    import json

    assert json.loads(base64.urlsafe_b64decode(runner.encode_world_info({"a": [0, 1]}))) == {"a": [0, 1]}


def test_parse_range_list_is_deepspeeds_strict_form():
    from dsrun.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2"):
        with pytest.raises(ValueError):
            parse_range_list(bad)
