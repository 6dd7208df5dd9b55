"""``deepspeed.accelerator.cuda_accelerator``: NVIDIA (and ROCm) GPUs through ``torch.cuda``, ranks over NCCL."""
from __future__ import annotations

import os

import torch

from dsrun.accelerator.device import Accelerator


class CUDA_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    supports_nvtx_domain = True
    launcher_envs = ("NCCL",)
    triton = True

    def __init__(self) -> None:
        super().__init__("cuda")

    def communication_backend_version(self) -> tuple[int, ...]:
        return torch.cuda.nccl.version()

    def is_fp16_supported(self) -> bool:
        """True from compute capability 7 (6.x only with ``DS_ALLOW_DEPRECATED_FP16=1``), or with no GPU to ask."""
        if not self.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels run here: a GPU of compute capability 8.0 or newer."""
        return self.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def prefer_triton_grouped_mm(self) -> bool:
        """Triton's grouped GEMM over ``torch._grouped_mm`` on sm7x/sm8x, where torch's op loops over the groups
        (fused from sm90); never on ROCm or without Triton."""
        import importlib.util

        if torch.version.hip is not None or not self.is_available() or importlib.util.find_spec("triton") is None:
            return False
        major, _ = torch.cuda.get_device_capability()
        return not hasattr(torch, "_grouped_mm") or 7 <= major < 9

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock ``num_bytes`` of host memory at ``address`` with the CUDA driver (``cudaHostRegister``)."""
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)))
        return True

    def unregister_host_memory(self, address: int) -> None:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(address)))
