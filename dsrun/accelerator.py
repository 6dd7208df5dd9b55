"""The accelerator layer: which device, which communication backend, whether to pin host memory.

One small object answers the device questions the rest of dsrun would otherwise branch on: CPU ranks talk
over gloo, CUDA ranks over NCCL, and only CUDA benefits from pinned host buffers. Everything else in the
engine is written once against this interface.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerator:
    """A device family (``cpu`` or ``cuda``) and the choices that follow from it."""

    name: str

    def device_name(self, index: int | None = None) -> str:
        """``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``."""
        if self.name == "cpu" or index is None:
            return self.name
        return f"{self.name}:{index}"

    def device(self, local_rank: int | None = None) -> torch.device:
        """The torch device this rank computes on."""
        if self.name == "cuda":
            index = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
            return torch.device("cuda", index)
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank)

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: NCCL for CUDA, gloo for CPU."""
        return "nccl" if self.name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return self.name == "cpu" or torch.cuda.is_available()

    def synchronize(self) -> None:
        """Wait for queued device work; timers call this so they measure work, not launches."""
        if self.name == "cuda":
            torch.cuda.synchronize()

    def pin_memory_enabled(self) -> bool:
        """Pinned host memory only speeds up host-to-CUDA copies; on CPU it is pointless."""
        return self.name == "cuda"

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.pin_memory_enabled() else tensor

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.name == "cuda" else 0


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator for this process: ``DSRUN_ACCELERATOR`` (cpu|cuda) if set, else CUDA when present."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        wanted = os.environ.get("DSRUN_ACCELERATOR", "").strip().lower()
        if wanted not in ("", "cpu", "cuda"):
            from dsrun.utils.errors import UserError

            raise UserError(f"DSRUN_ACCELERATOR: got {wanted!r}; allowed: cpu, cuda")
        if not wanted:
            wanted = "cuda" if torch.cuda.is_available() else "cpu"
        _ACCELERATOR = Accelerator(wanted)
    return _ACCELERATOR


def set_accelerator(accelerator: Accelerator | str) -> None:
    """Override the detected accelerator (tests, or forcing CPU on a GPU machine)."""
    global _ACCELERATOR
    _ACCELERATOR = accelerator if isinstance(accelerator, Accelerator) else Accelerator(accelerator)
