"""The bytes a ZeRO strategy holds for model state (``engine.memory_breakdown()``, the estimator's measure)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class MemoryBreakdown:
    """Bytes this rank holds for model state. ``padding`` counts the alignment padding inside the flat
    buffers (parameters and, at stages 1-2, the partitions); it is included in the other numbers."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    padding: int
    buffers: int = 0  # reusable communication staging buffers (bounded by the bucket sizes)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states + self.buffers

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += tensor_bytes(value)
    return total
