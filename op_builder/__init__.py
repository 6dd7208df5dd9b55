"""Builders for dsrun's compiled ops (``csrc/``): JIT through torch's cpp_extension + ninja, cached per sources,
flags and torch version; built ahead of time with ``dsrun ops build`` or ``DSRUN_BUILD_OPS=1 pip install .``.

``ALL_OPS`` maps each op name to its builder class; ``get_builder(name)`` returns a fresh builder.
``DEEPSPEED_ONLY`` are DeepSpeed's builder names (``FusedAdamBuilder`` loads the CPU Adam op; the CUDA ones say
they are not built here; ``CUDAOpBuilder`` computes DeepSpeed's CUDA build plan, as ``EvoformerAttnBuilder``'s
CUTLASS search does, without building), for ``deepspeed.ops.op_builder`` imports and ``deepspeed.ops.__compatible_ops__``.
"""
from __future__ import annotations

from op_builder.builder import (
    CompilerUnavailableError,
    CUDAOpBuilder,
    OpBuilder,
    OpBuildError,
    cache_root,
    compiler,
    csrc_root,
    simd_level,
)
from op_builder.evoformer_attn import EvoformerAttnBuilder
from op_builder.cpu_ops import AsyncIOBuilder, CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder, HostCacheBuilder
from op_builder.deepspeed_names import (
    DEEPSPEED_ONLY,
    FPQuantizerBuilder,
    GDSBuilder,
    FusedAdamBuilder,
    FusedLambBuilder,
    FusedLionBuilder,
    InferenceBuilder,
    PinMemoryBuilder,
    QuantizerBuilder,
    RaggedUtilsBuilder,
    SparseAttnBuilder,
    SpatialInferenceBuilder,
    TransformerBuilder,
    UtilsBuilder,
)

ALL_OPS: dict[str, type[OpBuilder]] = {
    b.NAME: b for b in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, AsyncIOBuilder, HostCacheBuilder)
}


def get_builder(name: str) -> OpBuilder:
    """A builder for the op called ``name`` (see ``ALL_OPS``); ValueError naming the known ops otherwise."""
    try:
        return ALL_OPS[name]()
    except KeyError:
        raise ValueError(f"unknown op {name!r}; expected one of {', '.join(ALL_OPS)}") from None


__all__ = ["ALL_OPS", "CUDAOpBuilder", "DEEPSPEED_ONLY", "EvoformerAttnBuilder", "FPQuantizerBuilder", "GDSBuilder", "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder", "InferenceBuilder", "PinMemoryBuilder",
           "QuantizerBuilder", "RaggedUtilsBuilder", "SparseAttnBuilder", "SpatialInferenceBuilder", "TransformerBuilder", "UtilsBuilder", "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder",
           "HostCacheBuilder",
           "CompilerUnavailableError", "OpBuildError", "OpBuilder", "cache_root", "compiler", "csrc_root",
           "get_builder", "simd_level"]
