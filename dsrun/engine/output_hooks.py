"""Run something once when backward first reaches a forward's outputs (DeepSpeed's
``runtime.utils.register_output_backward_hooks`` and ``OutputBackwardHookManager``).

A hook on every output tensor that has a ``grad_fn`` (found in tensors, tuples, lists and dicts, nested); the first
one backward reaches calls ``preprocess_once_fn()``, and each may transform its gradient with
``preprocess_per_tensor_fn(grad)``. The manager lives as long as the first output it hooked.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class OutputBackwardHookManager:
    """The hooks of one forward's outputs; ``hook_handles`` is empty when no output needs a gradient."""

    def __init__(self, preprocess_once_fn: Callable[[], Any],
                 preprocess_per_tensor_fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.preprocess_once_fn = preprocess_once_fn
        self.preprocess_per_tensor_fn = preprocess_per_tensor_fn
        self.preprocess_done = False
        self.hook_handles: list[Any] = []

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.preprocess_done:
            self.preprocess_done = True
            self.preprocess_once_fn()
        return grad if self.preprocess_per_tensor_fn is None else self.preprocess_per_tensor_fn(grad)

    def _tensors(self, outputs: object) -> list[torch.Tensor]:
        if isinstance(outputs, torch.Tensor):
            return [outputs] if outputs.grad_fn is not None else []
        items = outputs.values() if isinstance(outputs, dict) else outputs if isinstance(outputs, (tuple, list)) \
            else ()
        return [t for item in items for t in self._tensors(item)]

    def register_hooks_on_outputs(self, outputs: object) -> None:
        self.preprocess_done = False
        self.remove_hooks()
        tensors = self._tensors(outputs)
        self.hook_handles = [t.register_hook(self._hook) for t in tensors]
        if tensors:  # kept alive by the output, as DeepSpeed does
            managers = getattr(tensors[0], "_backward_hook_managers", None)
            if managers is None:
                managers = tensors[0]._backward_hook_managers = []  # type: ignore[attr-defined]
            managers.append(self)

    def remove_hooks(self) -> None:
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles.clear()

    def reset(self) -> None:
        self.preprocess_done = False


def register_output_backward_hooks(outputs: object, preprocess_once_fn: Callable[[], Any],
                                   preprocess_per_tensor_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                                   ) -> OutputBackwardHookManager:
    """Hook ``outputs`` (see the module docstring); returns the manager."""
    manager = OutputBackwardHookManager(preprocess_once_fn, preprocess_per_tensor_fn)
    manager.register_hooks_on_outputs(outputs)
    return manager
