"""``deepspeed.accelerator.cpu_accelerator``: DeepSpeed's CPU accelerator class, as dsrun's accelerator fixed to
the CPU (``set_accelerator(CPU_Accelerator())`` forces CPU ranks over gloo)."""
from __future__ import annotations

from dsrun.accelerator import Accelerator


class CPU_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    def __init__(self) -> None:
        super().__init__("cpu")
