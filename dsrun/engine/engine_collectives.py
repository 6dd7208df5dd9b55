"""DeepSpeed's gradient-reduction helpers on the engine (``allreduce_bucket``, ``buffered_allreduce_fallback``,
the sparse variants …): the building blocks a pipeline engine or a custom loop reduces ``.grad`` tensors with.

They follow DeepSpeed's averaging rules (``prescale_gradients``, ``gradient_predivide_factor``: the one rule
in :mod:`dsrun.zero.averaging`; ``communication_data_type``) and go through :mod:`dsrun.comm`. The
engine's own training loop does not use them: its ZeRO strategy reduces gradients in buckets during backward.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dsrun import comm
from dsrun.comm.comm import ProcessGroup
from dsrun.engine.sparse_tensor import SparseTensor
from dsrun.zero.averaging import gradient_averaging


class _Engine(Protocol):
    """What the reduction helpers read of the engine (its averaging settings, dtype and group)."""

    module: torch.nn.Module
    dp_group: ProcessGroup
    gradient_average: bool
    communication_data_type: torch.dtype

    def postscale_gradients(self) -> bool: ...

    def gradient_predivide_factor(self) -> float: ...

    def sparse_gradients_enabled(self) -> bool: ...


class Collectives:
    """DeepSpeed's reduction helpers over ``dp_group``: a part of the engine (``engine.collectives``), which
    carries each name as a one-line delegation; the averaging settings and the module are the engine's."""

    def __init__(self, engine: _Engine):
        self._engine = engine

    flatten = staticmethod(_flatten_dense_tensors)
    unflatten = staticmethod(_unflatten_dense_tensors)

    def allreduce_bucket(self, bucket: list[torch.Tensor], dp_group: ProcessGroup, dp_world_size: int | None = None
                         ) -> torch.Tensor:
        """The flattened, averaged sum of ``bucket`` over ``dp_group``."""
        tensor = self.flatten(bucket)
        engine = self._engine
        reduced = tensor if engine.communication_data_type == tensor.dtype else tensor.to(engine.communication_data_type)
        world = comm.get_world_size(dp_group) if dp_world_size is None else dp_world_size
        averaging = gradient_averaging(world, average=engine.gradient_average, prescale=not engine.postscale_gradients(),
                                       factor=engine.gradient_predivide_factor(), scatter=False)
        averaging.before(reduced)
        comm.all_reduce(reduced, group=dp_group)
        averaging.after(reduced)
        if reduced is not tensor:
            tensor.copy_(reduced)
        return tensor

    def allreduce_and_copy(self, small_bucket: list[torch.Tensor], dp_group: ProcessGroup,
                           dp_world_size: int | None = None) -> None:
        reduced = self.allreduce_bucket(small_bucket, dp_group, dp_world_size)
        for buf, synced in zip(small_bucket, self.unflatten(reduced, small_bucket)):
            buf.copy_(synced)

    def allreduce_no_retain(self, bucket: list[torch.Tensor], dp_group: ProcessGroup,
                            numel_per_bucket: int = 500_000_000, dp_world_size: int | None = None) -> None:
        """Average ``bucket``'s tensors in place, in flat buffers of about ``numel_per_bucket`` elements."""
        small, numel = [], 0
        for tensor in bucket:
            small.append(tensor)
            numel += tensor.numel()
            if numel > numel_per_bucket:
                self.allreduce_and_copy(small, dp_group, dp_world_size)
                small, numel = [], 0
        if small:
            self.allreduce_and_copy(small, dp_group, dp_world_size)

    def buffered_allreduce_fallback(self, grads: list[torch.Tensor] | None = None,
                                    elements_per_buffer: int = 500_000_000) -> None:
        """Average ``grads`` (default: the module parameters' ``.grad``) over the data-parallel group in
        place, dense ones in buffers per dtype, sparse ones (``sparse_gradients``) as gathered rows."""
        if grads is None:
            grads = [p.grad for p in self._engine.module.parameters() if p.grad is not None]
        dense: dict[torch.dtype, list[torch.Tensor]] = {}
        sparse: list[SparseTensor] = []
        for grad in grads:
            if grad.is_sparse and self._engine.sparse_gradients_enabled():
                sparse.append(SparseTensor(grad))
            else:
                dense.setdefault(grad.dtype, []).append(grad.to_dense() if grad.is_sparse else grad)
        for bucket in dense.values():
            self.allreduce_no_retain(bucket, self._engine.dp_group, numel_per_bucket=elements_per_buffer)
        if sparse:
            self.sparse_allreduce_no_retain(sparse, self._engine.dp_group)

    def sparse_allreduce_no_retain(self, bucket: list[SparseTensor], dp_group: ProcessGroup,
                                   dp_world_size: int | None = None) -> None:
        """Average the row-sparse tensors of ``bucket`` and write each back into its original tensor."""
        for tensor in self.sparse_allreduce_bucket(bucket, dp_group, dp_world_size):
            if tensor.is_sparse:
                tensor.orig_dense_tensor.data = tensor.to_coo_tensor()
            else:
                tensor.orig_dense_tensor.copy_(tensor.to_dense())

    def sparse_allreduce_bucket(self, bucket: list[SparseTensor], dp_group: ProcessGroup,
                                dp_world_size: int | None = None) -> list[SparseTensor]:
        return [self.sparse_allreduce(sparse, dp_group, dp_world_size) for sparse in bucket]

    def sparse_allreduce(self, sparse: SparseTensor, dp_group: ProcessGroup, dp_world_size: int | None = None
                         ) -> SparseTensor:
        """Every rank's rows, scaled for the average: the sum over ranks is the sum of the gathered rows."""
        original = sparse.values.dtype
        dtype = self._engine.communication_data_type
        values = sparse.values if dtype == original else sparse.values.to(dtype)
        world = comm.get_world_size(dp_group) if dp_world_size is None else dp_world_size
        if self._engine.postscale_gradients():
            if self._engine.gradient_average:
                values = values * (self._engine.gradient_predivide_factor() / world)
        else:
            values = values * (1.0 / world)
        sparse.indices = torch.cat(self.sparse_all_gather(sparse.indices, dp_group)).to(torch.long)
        sparse.values = torch.cat(self.sparse_all_gather(values, dp_group)).to(original)
        return sparse

    def sparse_all_gather(self, value: torch.Tensor, dp_group: ProcessGroup) -> list[torch.Tensor]:
        """Every rank's ``value`` (1-D or 2-D; the first dimension may differ between ranks)."""
        if value.dim() not in (1, 2):
            raise ValueError(f"sparse_all_gather: a 1-D or 2-D tensor is needed, got {value.dim()}-D")
        my_size = torch.tensor([value.size(0)], dtype=torch.long, device=value.device)
        sizes = [int(s.item()) for s in self.all_gather_scalar(my_size, dp_group)]
        longest = max(sizes)
        padded = torch.cat([value, value.new_zeros((longest - value.size(0),) + tuple(value.shape[1:]))])
        gathered = [padded.new_empty(padded.shape) for _ in sizes]
        comm.all_gather(gathered, padded, group=dp_group)
        return [t[:size] for t, size in zip(gathered, sizes)]

    def all_gather_scalar(self, value: torch.Tensor, dp_group: ProcessGroup) -> list[torch.Tensor]:
        out = [value.new_zeros(value.size()) for _ in range(comm.get_world_size(dp_group))]
        comm.all_gather(out, value, group=dp_group)
        return out
