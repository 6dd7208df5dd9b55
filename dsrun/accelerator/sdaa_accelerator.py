"""``deepspeed.accelerator.sdaa_accelerator``: Tecorigin SDAAs through ``torch.sdaa``, which ``torch_sdaa`` adds to
torch; ranks over TCCL. Without ``torch_sdaa`` the class still builds: ``is_available()`` is False and device
calls raise a RuntimeError naming the package."""
from __future__ import annotations

from dsrun.accelerator.device import Accelerator


class SDAA_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    package = "torch_sdaa"
    backend = "tccl"
    visible_envs = ("SDAA_VISIBLE_DEVICES",)
    launcher_envs = ("NCCL", "LD_LIBRARY", "PATH")
    triton = False

    def __init__(self) -> None:
        super().__init__("sdaa")
