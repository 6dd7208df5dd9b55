"""A graph's example inputs kept as metadata, made into tensors again on demand (DeepSpeed's
``deepspeed.compile.input_storage``).

The backend gets a graph's real inputs once, but AOT autograd may call the forward compiler more than once for it
(and a pass may want to run the graph again): what is kept is each tensor's shape, stride, dtype, device and
``requires_grad`` (not its memory), and :meth:`InputStorage.get` builds tensors of that layout filled with ones.
``keep_int_input_tensors`` keeps the values of integer and bool tensors (indices, masks: ones there can index out
of range or change the control flow), ``keep_all_input_tensors`` of every tensor; kept values are copied to host
memory and moved back on ``get``. Non-tensor values and the nesting of lists, tuples and dicts are kept as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_INTEGER_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                   torch.uint32, torch.uint64)


@dataclass
class TensorMetadata:
    """What :class:`InputStorage` keeps of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool
    layout: torch.layout
    memory_format: torch.memory_format = torch.contiguous_format
    real_data: torch.Tensor | None = None  # the values, on the host, where kept


class InputStorage:
    """One graph's inputs: :meth:`put` them, :meth:`get` tensors like them."""

    def __init__(self, keep_int_input_tensors: bool = False, keep_all_input_tensors: bool = False) -> None:
        self._stored: Any = None
        self._has_data = False
        self._keep_int_input_tensors = keep_int_input_tensors
        self._keep_all_input_tensors = keep_all_input_tensors

    def _keeps_values(self, tensor: torch.Tensor) -> bool:
        return self._keep_all_input_tensors or (self._keep_int_input_tensors and tensor.dtype in _INTEGER_DTYPES)

    def _store(self, value: object) -> Any:
        if isinstance(value, torch.Tensor):
            return TensorMetadata(tuple(value.shape), value.dtype, value.device, tuple(value.stride()),
                                  value.storage_offset(), value.requires_grad, value.layout,
                                  real_data=value.detach().cpu().clone() if self._keeps_values(value) else None)
        if isinstance(value, tuple):
            return tuple(self._store(v) for v in value)
        if isinstance(value, list):
            return [self._store(v) for v in value]
        if isinstance(value, dict):
            return {k: self._store(v) for k, v in value.items()}
        return value

    @staticmethod
    def _tensor(meta: TensorMetadata) -> torch.Tensor:
        if meta.real_data is not None:
            values = meta.real_data
        else:  # ones: a value no input of a real step would make invalid for arithmetic
            values = torch.ones(meta.shape, dtype=meta.dtype, layout=meta.layout)
        if tuple(values.stride()) != meta.stride and values.numel() > 0:
            # the same strides over fresh memory: as large as the layout reaches, the elements written in place
            span = meta.storage_offset + 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride))
            strided = torch.empty(span, dtype=meta.dtype).as_strided(meta.shape, meta.stride, meta.storage_offset)
            values = strided.copy_(values)
        return values.to(meta.device).requires_grad_(meta.requires_grad and values.is_floating_point())

    def _materialize(self, stored: object) -> Any:
        if isinstance(stored, TensorMetadata):
            return self._tensor(stored)
        if isinstance(stored, tuple):
            return tuple(self._materialize(v) for v in stored)
        if isinstance(stored, list):
            return [self._materialize(v) for v in stored]
        if isinstance(stored, dict):
            return {k: self._materialize(v) for k, v in stored.items()}
        return stored

    def put(self, real_inputs: object) -> None:
        """Keep ``real_inputs`` (replacing what was kept)."""
        self._stored = self._store(real_inputs)
        self._has_data = True

    def get(self) -> Any:
        """Fresh tensors like the inputs kept; ``RuntimeError`` when nothing was put."""
        if not self._has_data:
            raise RuntimeError("No inputs stored in InputStorage")
        return self._materialize(self._stored)

    def has_data(self) -> bool:
        return self._has_data

    def clear(self) -> None:
        self._stored = None
        self._has_data = False
