"""``deepspeed.inference.v2.kernels``: the kernel base class, and the refusal of DeepSpeed's CUDA kernels that
have no torch path here (:func:`cuda_kernel`)."""
from __future__ import annotations

from abc import ABC, abstractmethod


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


def cuda_kernel(path: str) -> type:
    """A stand-in class for DeepSpeed's CUDA-only ``path``: importing it works (as in DeepSpeed on a CPU), building
    it raises :class:`NotOnCPUError` with one line."""
    module, _, name = path.rpartition(".")

    def refuse(self, *args, **kwargs):
        raise NotOnCPUError(f"deepspeed.{path}: a CUDA kernel of DeepSpeed's inference v2 (FastGen), which dsrun "
                            f"does not provide (not on CPU); docs/inference.md lists the parts dsrun runs")

    return type(name, (), {"__init__": refuse, "__module__": f"dsrun.{module}",
                           "__doc__": f"DeepSpeed's CUDA ``{name}``: refused when built (:func:`cuda_kernel`)."})
