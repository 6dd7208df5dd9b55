"""``deepspeed.accelerator.klxpu_accelerator``: KUNLUNXIN XPUs, which ``torch_xmlir`` presents through ``torch.cuda``
(devices, streams, random numbers and memory are CUDA's); ranks over ``nccl``, as ``torch_xmlir`` serves it."""
from __future__ import annotations

import os

from dsrun.accelerator.cuda_accelerator import CUDA_Accelerator as CudaAccelerator  # one *_Accelerator name here


class KLXPU_Accelerator(CudaAccelerator):  # noqa: N801 - DeepSpeed's name
    supports_nvtx_domain = False
    package = "torch_xmlir"
    launcher_envs = ("BKCL", "XPU", "XMLIR", "LD_LIBRARY", "PATH")
    triton = False

    def __init__(self) -> None:
        super().__init__()  # torch's device type stays "cuda": that is what torch_xmlir presents
        self._name = "klxpu"

    def use_host_timers(self) -> bool:
        """Host timers unless ``XPU_EVENT_KL3_ENABLE=1``: the device's event timers read 0.0 without it."""
        return os.environ.get("XPU_EVENT_KL3_ENABLE", "0") != "1"

    def is_triton_supported(self) -> bool:
        return False

    def prefer_triton_grouped_mm(self) -> bool:
        return False
