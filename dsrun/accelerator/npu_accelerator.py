"""``deepspeed.accelerator.npu_accelerator``: Huawei Ascend NPUs through ``torch.npu``, which ``torch_npu`` adds to
torch; ranks over HCCL. Without ``torch_npu`` the class still builds: ``is_available()`` is False and device calls
raise a RuntimeError naming the package."""
from __future__ import annotations

from dsrun.accelerator.device import Accelerator


class NPU_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    package = "torch_npu"
    backend = "hccl"
    visible_envs = ("ASCEND_RT_VISIBLE_DEVICES",)
    launcher_envs = ("ASCEND", "HCCL", "LD_LIBRARY", "PATH")
    triton = False

    def __init__(self) -> None:
        super().__init__("npu")
