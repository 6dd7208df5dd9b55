"""``deepspeed.accelerator.supa_accelerator``: Biren SUPA GPUs through ``torch.supa``, which ``torch_supa`` adds to
torch; ranks over BCCL. Without ``torch_supa`` the class still builds: ``is_available()`` is False and device
calls raise a RuntimeError naming the package."""
from __future__ import annotations

from dsrun.accelerator.device import Accelerator


class SUPA_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    package = "torch_supa"
    backend = "bccl"
    visible_envs = ("SUPA_VISIBLE_DEVICES",)
    launcher_envs = ("BCCL", "BIREN", "SUPA", "LD_LIBRARY", "PATH")
    triton = True

    def __init__(self) -> None:
        super().__init__("supa")
