"""The loop the torch optimizers in this package share: closure, then one update per parameter with a grad."""
from __future__ import annotations

from typing import Any, Callable

import torch

from dsrun.utils.dynamo_free import DynamoFreeOptimizer


class PerParameterOptimizer(DynamoFreeOptimizer):
    """Subclasses implement :meth:`update` for one parameter; ``step`` handles the closure and the loop."""

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, p.grad, self.state[p], group)
        return loss
