"""DeepSpeed's ``deepspeed.runtime.sparse_tensor.SparseTensor``: a row-sparse gradient (an embedding's with
``sparse=True``) as the rows that hold values, for reductions that gather rows instead of summing dense
tensors (``engine.sparse_allreduce``)."""
from __future__ import annotations


import torch


class SparseTensor:
    """Rows ``indices`` of a ``dense_size`` tensor hold ``values`` (one row each); every other row is zero.
    Built from a sparse COO tensor or from a dense one (its non-zero rows). Repeated indices add up."""

    def __init__(self, dense_tensor: torch.Tensor | None = None):
        self.orig_dense_tensor = dense_tensor
        self.is_sparse = bool(dense_tensor is not None and dense_tensor.is_sparse)
        self.indices: torch.Tensor = torch.empty(0, dtype=torch.long)
        self.values: torch.Tensor = torch.empty(0)
        self.dense_size: list[int] = []
        self.dtype = dense_tensor.dtype if dense_tensor is not None else None
        if dense_tensor is None:
            return
        if dense_tensor.is_sparse:
            rows = dense_tensor if dense_tensor.sparse_dim() == 1 else dense_tensor.to_dense().to_sparse(1)
            coalesced = rows.coalesce()  # one index per row (an embedding's sparse gradient is row-sparse already)
            self.indices = coalesced.indices().flatten()
            self.values = coalesced.values()
        else:
            self.indices = (dense_tensor != 0).any(dim=1).nonzero().flatten()
            self.values = dense_tensor[self.indices]
        self.dense_size = list(dense_tensor.size())

    @staticmethod
    def type() -> str:
        return "deepspeed.SparseTensor"

    def to_coo_tensor(self) -> torch.Tensor:
        return torch.sparse_coo_tensor(self.indices.unsqueeze(0), self.values, self.dense_size)

    def to_dense(self) -> torch.Tensor:
        return self.values.new_zeros(self.dense_size).index_add_(0, self.indices.to(torch.long), self.values)

    def sparse_size(self) -> tuple[int, int]:
        """(elements held, elements of the dense tensor)."""
        index_size = self.indices.numel()
        value_size = self.values.numel()
        return index_size + value_size, int(torch.Size(self.dense_size).numel())

    def add(self, other: "SparseTensor") -> None:
        if self.dense_size != other.dense_size:
            raise ValueError(f"SparseTensor.add: sizes differ ({self.dense_size} vs {other.dense_size})")
        self.indices = torch.cat([self.indices, other.indices])
        self.values = torch.cat([self.values, other.values])

    def __repr__(self) -> str:
        held, dense = self.sparse_size()
        return f"SparseTensor(dense_size={self.dense_size}, rows={self.indices.numel()}, held={held}/{dense})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SparseTensor) and self.dense_size == other.dense_size
                and torch.equal(self.to_dense(), other.to_dense()))

    __hash__ = None  # type: ignore[assignment]
