"""Python wrappers over dsrun's compiled ops, with DeepSpeed's names.

- ``dsrun.ops.adam.DeepSpeedCPUAdam``, ``dsrun.ops.adagrad.DeepSpeedCPUAdagrad``,
  ``dsrun.ops.lion.DeepSpeedCPULion``: ``torch.optim.Optimizer`` subclasses over the SIMD + OpenMP kernels.
- ``dsrun.ops.aio.AsyncIOHandle`` (alias ``aio_handle``): async tensor <-> file I/O for NVMe offload.
- ``dsrun.ops.transformer`` (``DeepSpeedTransformerLayer``) and ``dsrun.ops.sparse_attention``
  (``SparseSelfAttention`` and the sparsity layouts): DeepSpeed's CUDA/Triton kernels as plain torch, so
  nothing to compile; they run on CPU and CUDA (docs/transformer_kernel.md, docs/sparse_attention.md).

Each compiled op is built on first use (see ``op_builder``). Without a working C++ compiler the wrappers use a
pure-torch implementation and warn once (:class:`dsrun.ops.loader.OpFallbackWarning`); a build that fails for
any other reason raises ``op_builder.OpBuildError`` with the compiler's output.
"""


def compatible_ops() -> dict[str, bool]:
    """Op name -> whether it can be built and run on this machine (DeepSpeed's op names included: those dsrun
    does not build are False)."""
    from op_builder import ALL_OPS, DEEPSPEED_ONLY

    builders = [*ALL_OPS.values(), *DEEPSPEED_ONLY]
    return {builder.NAME: builder().is_compatible()[0] for builder in builders}


def __getattr__(name: str):
    # DeepSpeed's ``deepspeed.ops.__compatible_ops__``
    if name == "__compatible_ops__":
        return compatible_ops()
    raise AttributeError(f"module 'dsrun.ops' has no attribute '{name}'")
