"""The base of dsrun's own torch optimizers: ``torch.optim.Optimizer`` without the import of ``torch._dynamo`` that
the first call of one of its methods makes in a process that never compiles.

torch wraps ``Optimizer.add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` in
``torch._disable_dynamo`` (``torch/_compile.py``), so that a ``torch.compile``'d caller does not trace into them;
the wrapper imports ``torch._dynamo`` on its first call: ~1.2 s of CPU and ~70 MiB of resident memory in every rank
that builds an optimizer (``add_param_group`` runs in ``__init__``; torch 2.13 on CPU). Dynamo traces a frame only
once ``torch._dynamo`` has been imported (``torch.compile`` imports it before it compiles anything), so until then
the wrapper has nothing to disable. :class:`DynamoFreeOptimizer`'s four methods call torch's own function
undecorated while ``torch._dynamo`` is not imported, and torch's wrapped method, which disables dynamo as torch's
does, once it is.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

_DISABLED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def _dynamo_free(name: str) -> Callable[..., object]:
    wrapped = getattr(torch.optim.Optimizer, name)
    plain = getattr(wrapped, "__wrapped__", wrapped)  # functools.wraps in torch._disable_dynamo sets it

    def method(self: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
        if "torch._dynamo" in sys.modules:  # dynamo may be tracing: disable it, as torch does
            return wrapped(self, *args, **kwargs)
        return plain(self, *args, **kwargs)

    method.__name__, method.__qualname__ = name, f"DynamoFreeOptimizer.{name}"
    method.__doc__ = wrapped.__doc__
    return method


class DynamoFreeOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose dynamo-disabled methods import ``torch._dynamo`` only once something else
    has (module docstring); everything else is torch's."""


for _name in _DISABLED:
    setattr(DynamoFreeOptimizer, _name, _dynamo_free(_name))
