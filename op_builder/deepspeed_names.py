"""DeepSpeed's op-builder names that scripts and tests import (``deepspeed.ops.op_builder.X``).

``FusedAdamBuilder`` is DeepSpeed's fused Adam; on a CPU it is the CPU Adam kernel (``dsrun.ops.adam.FusedAdam``
steps with it), so this builder loads the ``cpu_adam`` op. ``UtilsBuilder`` (flatten, unflatten, byte casts),
``RaggedUtilsBuilder`` (inference v2's host buffers and byte views), ``InferenceBuilder`` and
``SpatialInferenceBuilder`` (v1 inference's element-wise and norm kernels) are torch; ``PinMemoryBuilder``'s
page-locked allocator is libc's ``posix_memalign`` + ``mlock`` through ctypes (``dsrun/utils/pin_memory.py``). The others name DeepSpeed CUDA ops dsrun does not
build: their ``is_compatible()`` is False with the reason, and ``load()`` raises :class:`OpBuildError`, the same
answer DeepSpeed gives on a machine where the op cannot be built.
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from op_builder.builder import CUDAOpBuilder, OpBuilder, OpBuildError
from op_builder.cpu_ops import CPUAdamBuilder
from op_builder.evoformer_attn import EvoformerAttnBuilder


class FusedAdamBuilder(CPUAdamBuilder):
    NAME = "fused_adam"

    def load(self, verbose: bool = False) -> ModuleType:
        builder = CPUAdamBuilder()
        module = builder.load(verbose)
        self.last_load = builder.last_load
        return module


def _cast_to_byte_tensor(tensors: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """Each contiguous tensor's bytes as a 1-D uint8 tensor over the same memory (same ``data_ptr``)."""
    if isinstance(tensors, (list, tuple)):
        return [_cast_to_byte_tensor(t) for t in tensors]
    if not tensors.is_contiguous():
        raise ValueError("cast_to_byte_tensor needs a contiguous tensor")
    return tensors.reshape(-1).view(torch.uint8)


class UtilsBuilder(OpBuilder):
    """DeepSpeed's ``utils`` op (``flatten``, ``unflatten``, ``cast_to_byte_tensor``), which DeepSpeed compiles;
    here the same three functions in torch, so there is nothing to build."""

    NAME = "utils"

    def load(self, verbose: bool = False) -> ModuleType:
        module = ModuleType("deepspeed.ops.utils_op", self.__doc__)
        module.flatten = _flatten_dense_tensors
        module.unflatten = _unflatten_dense_tensors
        module.cast_to_byte_tensor = _cast_to_byte_tensor
        return module


class PinMemoryBuilder(OpBuilder):
    """DeepSpeed's ``pin_memory`` op: ``load().pin_handle()`` is the process's page-locked host allocator
    (``new_cpu_locked_tensor``, ``free_cpu_locked_tensor``, ``is_pinned``), nothing to build."""

    NAME = "pin_memory"

    def load(self, verbose: bool = False) -> ModuleType:
        from dsrun.utils.pin_memory import pin_handle

        module = ModuleType("deepspeed.ops.pin_memory.pin_memory_op", self.__doc__)
        module.pin_handle = pin_handle
        return module


def _allocate_fast_host_buffer(like: torch.Tensor) -> torch.Tensor:
    from dsrun.inference.v2.ragged.ragged_manager import fast_host_buffer
    return fast_host_buffer(like)


class RaggedUtilsBuilder(OpBuilder):
    """DeepSpeed's ``ragged_device_ops`` host helpers for inference v2: ``allocate_fast_host_buffer(t)`` (a host
    tensor shaped as ``t``, pinned where the accelerator pins), ``allocate_view_on(t, buffer, offset)`` and
    ``allocate_view_like(shape, strides, dummy, buffer, offset)`` (a tensor of ``t``'s, or the given, dtype,
    shape and strides over the bytes of a flat uint8 ``buffer``); torch here, nothing to build."""

    NAME = "ragged_device_ops"

    def load(self, verbose: bool = False) -> ModuleType:
        module = ModuleType("deepspeed.ops.ragged_device_ops_op", self.__doc__)
        from dsrun.inference.v2.allocator import view_on_bytes

        module.allocate_fast_host_buffer = _allocate_fast_host_buffer
        module.allocate_view_on = lambda tensor, buffer, offset: view_on_bytes(
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, buffer, offset)
        module.allocate_view_like = lambda shape, strides, dummy, buffer, offset: view_on_bytes(
            tuple(shape), tuple(strides), dummy.dtype, buffer, offset)
        return module


class _Unbuilt(OpBuilder):
    """A DeepSpeed op dsrun does not build; ``WHAT`` says what to use instead."""

    WHAT = ""

    def is_compatible(self) -> tuple[bool, str]:
        return False, f"op '{self.NAME}' is a DeepSpeed CUDA kernel dsrun does not build; {self.WHAT}"

    def load(self, verbose: bool = False) -> ModuleType:
        raise OpBuildError(self.is_compatible()[1])


class FusedLambBuilder(_Unbuilt):
    NAME, WHAT = "fused_lamb", "optimizer type Lamb runs dsrun.optim.Lamb"


class FusedLionBuilder(_Unbuilt):
    NAME, WHAT = "fused_lion", "optimizer type Lion runs the CPU Lion kernel"


class TransformerBuilder(_Unbuilt):
    NAME, WHAT = "transformer", "dsrun.ops.transformer is plain torch"


class SparseAttnBuilder(_Unbuilt):
    NAME, WHAT = "sparse_attn", "dsrun.ops.sparse_attention is plain torch"


class QuantizerBuilder(_Unbuilt):
    NAME, WHAT = "quantizer", "dsrun's quantizers are plain torch"


class InferenceBuilder(OpBuilder):
    """DeepSpeed's v1 inference kernels (``transformer_inference``: bias adds and activations, the norms, the
    residual adds, PR-MoE's residual mix), which DeepSpeed compiles for CUDA; here their math in torch
    (``dsrun/ops/transformer/inference/kernels.py``) under the binding's names, so there is nothing to build. The
    GEMM and attention kernels of the binding (``qkv_gemm_*``, ``softmax_context_*`` ...) are not among them."""

    NAME = "transformer_inference"

    def load(self, verbose: bool = False) -> ModuleType:
        from dsrun.ops.transformer.inference.kernels import inference_module

        return inference_module()


class SpatialInferenceBuilder(OpBuilder):
    """DeepSpeed's ``spatial_inference`` op (the NHWC bias adds of Stable Diffusion's UNet/VAE) in torch."""

    NAME = "spatial_inference"

    def load(self, verbose: bool = False) -> ModuleType:
        from dsrun.ops.transformer.inference.kernels import spatial_module

        return spatial_module()


class FPQuantizerBuilder(CUDAOpBuilder):
    """DeepSpeed's FP6/FP8/FP12 quantizer (``deepspeed.linear``'s quantized weights): a CUDA kernel for compute
    capability 8.0 and above, never built by dsrun; its quantizer in torch is ``dsrun.ops.fp_quantizer``."""

    NAME = "fp_quantizer"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.fp_quantizer.{self.NAME}_op"

    @staticmethod
    def get_default_quant_dtype():
        import torch

        return torch.uint8

    @staticmethod
    def get_quant_range(q_bits: int) -> float:
        """The magnitude a group's largest value is scaled to: 480 for FP8 (E4M3), 510 FP12, 28 FP6, 6 FP4."""
        from dsrun.ops.fp_quantizer.quantize import Q_RANGE

        mantissa = {8: 3, 12: 4, 6: 2, 4: 1}.get(q_bits)
        if mantissa is None:
            raise ValueError(f"FPQuantizerBuilder.get_quant_range: q_bits={q_bits}; expected 8, 12, 6 or 4")
        return Q_RANGE[(q_bits, mantissa)]

    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        split = [cc.split(".") for cc in ccs]
        pruned = [cc for cc in split if int(cc[0]) < 8]
        if pruned:
            self.warning(f"Filtered compute capabilities {pruned}")
        return [cc for cc in split if int(cc[0]) >= 8]


class GDSBuilder(CUDAOpBuilder):
    """DeepSpeed's GPUDirect Storage I/O (NVIDIA's cuFile: NVMe to GPU memory without a host bounce), never built
    by dsrun; dsrun's NVMe path is the async I/O op through host buffers (``AsyncIOBuilder``)."""

    NAME = "gds"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.gds.{self.NAME}_op"


DEEPSPEED_ONLY: tuple[type[OpBuilder], ...] = (FusedAdamBuilder, FusedLambBuilder, FusedLionBuilder,
                                                TransformerBuilder, SparseAttnBuilder, QuantizerBuilder,
                                                InferenceBuilder, SpatialInferenceBuilder, UtilsBuilder, PinMemoryBuilder,
                                                RaggedUtilsBuilder, EvoformerAttnBuilder, FPQuantizerBuilder, GDSBuilder)
