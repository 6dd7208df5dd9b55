"""DeepSpeed's smaller ``runtime.zero.partition_parameters`` names, on dsrun's ZeRO-3 mechanisms.

:mod:`dsrun.zero.init` is that module under the alias and re-exports these; they live here to keep it short.

* :data:`partitioned_param_data_shape`: the shape of a partitioned parameter's ``.data`` placeholder, ``[0]``
  (:func:`dsrun.zero.partition_params.partition_param`).
* :class:`MultipleAllGatherHandles`: several gathers in flight waited on as one.
* :func:`get_allgather_dtype`: the dtype a parameter is gathered in: its ``comm_dtype`` under ``torch_autocast``
  (:mod:`dsrun.precision.torch_autocast`), else its shard's.
* :class:`CUDAQuantizer`: ZeRO++'s weight quantizer (``zero_quantized_weights``); on dsrun its default kernel is
  :class:`TorchQuantizerKernel`, the symmetric INT8 block quantizer of :mod:`dsrun.comm.quantized`.
* :func:`_contradicting_single_rank_pg_error`: why ``zero.Init`` refuses a one-rank group under a multi-process
  launcher (:class:`dsrun.zero.Init` raises it).
* :class:`InsertPostInitMethodToModuleSubClasses`: DeepSpeed's base of ``Init``, and where
  ``memory_efficient_linear`` records ``torch.nn.functional.linear`` as it was before (``linear_bk``) when it
  routes it through :func:`dsrun.zero.linear.zero3_linear_wrap` (:func:`enable_memory_efficient_linear`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from dsrun.comm import quantized
from dsrun.ops.groupwise_quant import wrap_quantized_functional
from dsrun.precision.torch_autocast import get_comm_dtype, has_comm_dtype
from dsrun.zero import linear

__all__ = ["CUDAQuantizer", "InsertPostInitMethodToModuleSubClasses", "MultipleAllGatherHandles",
           "TorchQuantizerKernel", "_contradicting_single_rank_pg_error", "enable_memory_efficient_linear",
           "get_allgather_dtype", "partitioned_param_data_shape"]

partitioned_param_data_shape = [0]


class AllGatherHandle(Protocol):
    def wait(self, *, handle_dependency: bool = True) -> None: ...


class MultipleAllGatherHandles:
    """Handles of gathers in flight, waited on in order; ``handle_dependency`` goes to each by keyword (a
    handle may take it keyword-only or through ``**kwargs``)."""

    def __init__(self, handles: Sequence[AllGatherHandle]):
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


def get_allgather_dtype(param: torch.Tensor, param_ds_tensor: torch.Tensor) -> torch.dtype:
    """The dtype ``param`` is gathered in: its ``torch_autocast`` communication dtype when it has one, else
    the dtype of its shard ``param_ds_tensor``."""
    return get_comm_dtype(param) if has_comm_dtype(param) else param_ds_tensor.dtype


class TorchQuantizerKernel:
    """DeepSpeed's ``QuantizerBuilder`` op as :class:`CUDAQuantizer` calls it, in torch: symmetric INT8 codes
    with one fp32 scale per group (:func:`dsrun.comm.quantized.quantize`). Like the CUDA kernel, it returns
    fp16 from :meth:`dequantize`."""

    Symmetric = 0
    Asymmetric = 1

    def quantize(self, param: torch.Tensor, groups: int, num_bits: int, quant_type: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if quant_type != self.Symmetric:
            raise ValueError("only symmetric quantization is provided (CUDAQuantizer asks for nothing else)")
        codes, scales = quantized.quantize(param, num_bits, param.numel() // groups)
        return codes, scales

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor, num_groups: int, num_bits: int,
                   quant_type: int) -> torch.Tensor:
        block = quantized_param.numel() // num_groups
        return quantized.dequantize(quantized_param, scale, block).to(torch.half)


class CUDAQuantizer:
    """ZeRO++'s weight quantizer, DeepSpeed's interface: :meth:`quantize` picks a group count (groups of at
    most 16k elements, a multiple of 8 elements each, cached per size) and returns ``(int8 codes, scales)``;
    :meth:`dequantize` gives the values back in ``dtype``. The kernel is the class attribute
    ``quantizer_cuda_module`` (DeepSpeed's compiled op; here :class:`TorchQuantizerKernel` unless set), which
    reads fp16, so a parameter goes in as fp16 whatever its dtype."""

    async_flag = True
    target_group_size = 8000
    group_size_cache: dict[int, int] = {}
    quantizer_cuda_module: Any = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = TorchQuantizerKernel()

    def _groups(self, numel: int) -> int:
        if numel in self.group_size_cache:
            return self.group_size_cache[numel]
        groups = math.ceil(numel / self.target_group_size)
        while groups < numel and numel % (8 * groups):
            groups += 1
        while numel % (8 * groups * 2) == 0 and numel / groups > self.target_group_size:
            groups *= 2
        if numel % (8 * groups) or numel / groups >= 16000 or numel <= groups:
            raise ValueError(f"a quantized weight needs a multiple of 8 elements in groups under 16k; "
                             f"{numel} elements have no such grouping")
        self.group_size_cache[numel] = groups
        return groups

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        groups = self._groups(param.numel()) if groups is None else groups
        kernel = self.quantizer_cuda_module
        return kernel.quantize(param.to(dtype=torch.half), groups, 8, kernel.Symmetric)

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        kernel = self.quantizer_cuda_module
        values = kernel.dequantize(quantized_param, scale, scale.numel(), 8, kernel.Symmetric)
        return values.to(dtype) if dtype is not None and values.dtype != dtype else values


def _contradicting_single_rank_pg_error(dp_world_size: int, explicit_process_group: object,
                                        env: Mapping[str, str | None] | None = None) -> str | None:
    """The message ``zero.Init`` raises when the launcher started several processes (``WORLD_SIZE`` > 1) but the
    group it would partition over has one rank, typically a one-rank default group someone initialised before
    (every rank would then hold the whole model); None otherwise. A one-rank group passed explicitly
    (``explicit_process_group``) is taken as meant, and a missing or unreadable ``WORLD_SIZE`` as one process."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init would partition over a process group of 1 rank while the launcher started WORLD_SIZE="
            f"{launched} processes (a one-rank group was initialised before zero.Init, e.g. by from_pretrained "
            f"before deepspeed.init_distributed()): nothing would be partitioned and every rank would hold the "
            f"whole model. Call deepspeed.init_distributed() before building the model under zero.Init, or pass "
            f"data_parallel_group= if one rank is meant.")


class InsertPostInitMethodToModuleSubClasses:
    """DeepSpeed's base class of ``zero.Init`` (the context that hooks every module class's ``__init__``;
    dsrun's :class:`dsrun.zero.Init` derives from it). ``linear_bk`` appears the first time
    ``memory_efficient_linear`` routes ``F.linear`` through ZeRO-3's linear: the function it replaced."""

    linear_bk: Any  # set by enable_memory_efficient_linear, absent before

    def _enable_mem_efficient_linear(self) -> None:
        enable_memory_efficient_linear()


def enable_memory_efficient_linear() -> None:
    """Route ``torch.nn.functional.linear`` through :func:`dsrun.zero.linear.zero3_linear_wrap`, for the rest of
    the process, as DeepSpeed does: the first call records the function it replaces in
    ``InsertPostInitMethodToModuleSubClasses.linear_bk``, and ``F.linear`` is replaced only while it is still that
    function, so a wrapper installed over ZeRO-3's linear since (weight quantization's) is kept. Idempotent."""
    base = InsertPostInitMethodToModuleSubClasses
    current = F.linear
    # weight quantization's wrapper over torch's linear (an engine without ZeRO-3 installed it): ZeRO-3's linear
    # goes under it, so quantized weights are still dequantized
    quantized_over = current.__wrapped__ if getattr(current, "_ds_quantized", False) else None
    if not hasattr(base, "linear_bk"):
        base.linear_bk = quantized_over or current
    if current is base.linear_bk:
        F.linear = linear.zero3_linear_wrap
    elif quantized_over is not None and quantized_over is base.linear_bk:
        F.linear = wrap_quantized_functional(linear.zero3_linear_wrap)
