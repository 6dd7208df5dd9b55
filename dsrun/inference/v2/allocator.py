"""``deepspeed.inference.v2.allocator``: views of preallocated buffers (``empty_from``, ``view_on_bytes``) and
``on_device``."""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Callable, Iterable

import torch

from dsrun.accelerator import get_accelerator


class Allocator:
    """Views into preallocated buffers, cached per (buffer, shape): a module's output for a batch of N tokens is the
    first N rows of the buffer sized for ``max_tokens``, with no new allocation."""
    cache: dict = defaultdict(dict)

    @staticmethod
    def empty_from(tensor: torch.Tensor, shape: Iterable[int]) -> torch.Tensor:
        shape = tuple(shape)
        views = Allocator.cache[tensor]
        if shape not in views:
            size = math.prod(shape)
            if size == 0:
                raise ValueError("Cannot create empty tensor with size 0")
            views[shape] = tensor.flatten()[:size].view(shape)
        return views[shape]


empty_from = Allocator.empty_from


def view_on_bytes(shape: tuple, strides: tuple, dtype: torch.dtype, buffer: torch.Tensor, offset: int) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` and ``strides`` over the bytes of the flat uint8 ``buffer`` from byte
    ``offset`` (DeepSpeed's ``allocate_view_on``/``allocate_view_like``); ValueError if it does not fit."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides)) if all(shape) else 0
    if offset % itemsize != 0 or offset + extent * itemsize > buffer.numel():
        raise ValueError(f"a {dtype} view of {extent} elements at byte {offset} does not fit a {buffer.numel()}-byte "
                         "buffer on its element boundary")
    return buffer[offset:offset + extent * itemsize].view(dtype).as_strided(tuple(shape), tuple(strides))


def on_device(method: Callable) -> Callable:
    """A method whose returned tensor is moved to the accelerator's current device. DeepSpeed moves it to
    ``current_device()``, an index that torch reads as a CUDA device, which fails on a CPU; the device's name
    (``cuda:0`` or ``cpu``) is the same place on CUDA and works on a CPU."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        tensor = method(self, *args, **kwargs)
        if isinstance(tensor, torch.Tensor):
            return tensor.to(current_device())
        return tensor

    return wrapped


def current_device() -> torch.device:
    """The device inference-v2 parameters live on: the accelerator's current device, by name."""
    return torch.device(get_accelerator().current_device_name())
