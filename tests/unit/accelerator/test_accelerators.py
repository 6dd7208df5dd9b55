"""DeepSpeed's accelerator classes: every family builds and answers through its torch module, a family whose
package is absent says so, and ``DS_ACCELERATOR`` picks one as DeepSpeed does."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import dsrun.accelerator as accel
from dsrun.accelerator import DeepSpeedAccelerator, real_accelerator
from dsrun.accelerator.cpu_accelerator import CPU_Accelerator
from dsrun.accelerator.cuda_accelerator import CUDA_Accelerator
from dsrun.accelerator.npu_accelerator import NPU_Accelerator
from dsrun.utils.errors import ConfigError

BUILDS_WITHOUT_ITS_DEVICE = ["cpu", "cuda", "xpu", "npu", "mlu", "sdaa", "supa", "mps", "klxpu"]


@pytest.fixture
def fresh_choice(monkeypatch):
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)
    for key in ("DS_ACCELERATOR", "DSRUN_ACCELERATOR"):
        monkeypatch.delenv(key, raising=False)


def test_every_family_implements_the_whole_interface():
    assert sorted(real_accelerator.SUPPORTED_ACCELERATOR_LIST) == sorted(BUILDS_WITHOUT_ITS_DEVICE + ["hpu"])
    for name in real_accelerator.SUPPORTED_ACCELERATOR_LIST:
        cls = real_accelerator.accelerator_class(name)
        assert issubclass(cls, DeepSpeedAccelerator) and not inspect.isabstract(cls), name
    with pytest.raises(TypeError, match="abstract"):  # the interface is enforced: a class missing one fails
        type("Half_Accelerator", (DeepSpeedAccelerator, ), {"device_name": lambda self, i=None: "x"})()


@pytest.mark.parametrize("name", BUILDS_WITHOUT_ITS_DEVICE)
def test_a_family_builds_and_names_its_device_backend_and_variables(name):
    accelerator = real_accelerator.accelerator_class(name)()
    expected_backend = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "npu": "hccl", "mlu": "cncl", "sdaa": "tccl",
                        "supa": "bccl", "mps": "gloo", "klxpu": "nccl"}[name]
    assert accelerator.communication_backend_name() == expected_backend and accelerator._name == name
    env: dict[str, str] = {}
    accelerator.set_visible_devices_envs(env, [2, 3])
    assert env == {key: "2,3" for key in accelerator.visible_devices_envs()} and env
    assert accelerator.get_compile_backend() == "inductor"
    made = accelerator.LongTensor  # DeepSpeed's constructor of a tensor on the family's device
    assert made.keywords == {"dtype": torch.int64, "device": accelerator.device_name()}


def test_cuda_delegates_to_torch_cuda_and_an_absent_package_is_named():
    cuda = CUDA_Accelerator()
    assert cuda.is_available() == torch.cuda.is_available()
    assert cuda.device(1) == torch.device("cuda", 1) and cuda.device_name(1) == "cuda:1"
    assert cuda.device_name() == "cuda"
    assert cuda.on_accelerator(torch.empty(0, device="meta")) is False
    assert cuda.create_op_builder("CPUAdamBuilder").NAME == "cpu_adam" and cuda.get_op_builder("no_such") is None
    if not torch.cuda.is_available():
        assert not cuda.is_triton_supported() and not cuda.prefer_triton_grouped_mm()
        assert cuda.device_count() == 0 == torch.cuda.device_count()
    npu = NPU_Accelerator()
    assert not npu.is_available()  # torch_npu is not installed here
    with pytest.raises(RuntimeError, match="torch.npu.*torch_npu"):
        npu.device_count()
    with pytest.raises(ValueError, match="habana_frameworks"):
        real_accelerator.accelerator_class("hpu")()


def test_cpu_answers_as_the_host():
    cpu = CPU_Accelerator()
    assert cpu.is_synchronized_device() and cpu.use_host_timers() and cpu.Stream() is None
    assert cpu.lazy_call(lambda: 7) == 7 and cpu.default_generator(0) is torch.default_generator
    assert cpu.memory_stats() == {} and cpu.total_memory() >= cpu.available_memory() > 0
    assert cpu.export_envs() == [] and cpu.create_op_builder("CPUAdamBuilder") is not None
    assert torch.equal(cpu.FloatTensor([1.5, 2.0]), torch.tensor([1.5, 2.0]))


def test_ds_accelerator_selects_as_deepspeed_does(fresh_choice, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert type(accel.get_accelerator()) is CPU_Accelerator and accel.is_current_accelerator_supported()
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "npu")  # named but not installed: DeepSpeed's ValueError, a user's error
    with pytest.raises(ConfigError, match="NPU_Accelerator requires torch_npu"):
        accel.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR: must be one of"):
        accel.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("DSRUN_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="disagree"):
        accel.get_accelerator()
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.delenv("DSRUN_ACCELERATOR")
    expected = CUDA_Accelerator if torch.cuda.is_available() else CPU_Accelerator
    assert type(accel.get_accelerator()) is expected  # detected: no XPU, NPU, ... package on a test machine
    with pytest.raises(AssertionError, match="not subclass of DeepSpeedAccelerator"):
        accel.set_accelerator(object())
    accel.set_accelerator("cpu")
    assert accel.get_accelerator() == CPU_Accelerator()


@pytest.mark.parametrize("name", ["xpu", "klxpu"])
def test_each_family_module_holds_one_accelerator_class(name):
    """DeepSpeed's test of its modules finds a module's class by the one name ending in ``_Accelerator``."""
    module = importlib.import_module(f"dsrun.accelerator.{name}_accelerator")
    assert [n for n in dir(module) if n.endswith("_Accelerator")] == [f"{name.upper()}_Accelerator"]
