"""``deepspeed.inference.v2.allocator``: views of preallocated buffers (``empty_from``) and ``on_device``."""
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
