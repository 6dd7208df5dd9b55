"""``deepspeed.inference.v2.kernels``: the kernel base class, and the refusal of the few DeepSpeed CUDA kernels and
FastGen parts that have no torch path here (:func:`cuda_kernel`, :func:`cuda_function`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, NoReturn


class DSKernelBase(ABC):
    """A kernel: ``__init__`` validates the configuration it will run (and, in DeepSpeed, compiles); ``__call__``
    runs it on tensors it is given, allocating nothing."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        raise NotImplementedError()

    @abstractmethod
    def __call__(self, *args, **kwargs):
        raise NotImplementedError()


class NotOnCPUError(ValueError):
    """A DeepSpeed inference-v2 kernel or module that exists only as CUDA code. A ValueError, as DeepSpeed's own
    "This op had not been implemented on CPU backend", so the modules that probe a kernel (``supports_config``)
    read it as "not supported"."""


def not_on_cpu(path: str, what: str = "a CUDA kernel of DeepSpeed's inference v2 (FastGen)") -> NotOnCPUError:
    """The one-line refusal of DeepSpeed's ``deepspeed.<path>``."""
    return NotOnCPUError(f"deepspeed.{path}: {what}, which dsrun does not provide (not on CPU); docs/inference.md "
                         "lists the parts of FastGen dsrun runs, and dsrun.init_inference runs models on a CPU")


def cuda_kernel(path: str, what: str = "a CUDA kernel of DeepSpeed's inference v2 (FastGen)") -> type:
    """A stand-in class for DeepSpeed's CUDA-only ``path``: importing it works (as in DeepSpeed on a CPU), building
    it raises :class:`NotOnCPUError` with one line."""
    module, _, name = path.rpartition(".")

    def refuse(self, *args, **kwargs):
        raise not_on_cpu(path, what)

    return type(name, (), {"__init__": refuse, "__module__": f"dsrun.{module}",
                           "__doc__": f"DeepSpeed's CUDA ``{name}``: refused when built (:func:`cuda_kernel`)."})


def cuda_function(path: str, what: str) -> Callable[..., NoReturn]:
    """A stand-in for DeepSpeed's function ``path`` that runs CUDA kernels: calling it raises :func:`not_on_cpu`."""

    def refuse(*args, **kwargs) -> NoReturn:
        raise not_on_cpu(path, what)

    refuse.__name__ = path.rpartition(".")[2]
    return refuse
