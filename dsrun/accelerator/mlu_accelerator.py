"""``deepspeed.accelerator.mlu_accelerator``: Cambricon MLUs through ``torch.mlu``, which ``torch_mlu`` adds to
torch; ranks over CNCL. Without ``torch_mlu`` the class still builds: ``is_available()`` is False and device calls
raise a RuntimeError naming the package."""
from __future__ import annotations

from dsrun.accelerator.device import Accelerator


class MLU_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    package = "torch_mlu"
    backend = "cncl"
    visible_envs = ("MLU_VISIBLE_DEVICES",)
    launcher_envs = ("NEUWARE_HOME", "CNCL", "LD_LIBRARY", "PATH")
    triton = True

    def __init__(self) -> None:
        super().__init__("mlu")
