"""``deepspeed.accelerator.hpu_accelerator``: Intel Gaudi HPUs through ``habana_frameworks.torch.hpu``, ranks over
HCCL. As DeepSpeed's, the class refuses to build (ValueError) where Habana's package is not installed, and sets
Gaudi's workaround variables (``PT_HPU_LAZY_ACC_PAR_MODE=0``, ``PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES=0``) unless set.
"""
from __future__ import annotations

import os

import torch

from dsrun.accelerator.device import Accelerator


class HPU_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    package = "habana_frameworks.torch.hpu"
    backend = "hccl"
    compile_backend = "hpu_backend"

    def __init__(self) -> None:
        super().__init__("hpu")
        for key in ("PT_HPU_LAZY_ACC_PAR_MODE", "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES"):
            os.environ.setdefault(key, "0")
        try:
            import habana_frameworks.torch.hpu as hpu
        except ImportError as e:
            raise ValueError("HPU_Accelerator requires habana_frameworks.torch.hpu, which is not installed on this "
                             "system.") from e
        self.hpu = hpu
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # Gaudi's memory mapping needs it off
        self.fp16_supported: bool | None = None

    @property
    def module(self):
        return self.hpu

    def is_available(self) -> bool:
        return self.hpu.is_available()

    def use_host_timers(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "hpu"  # one device per process: the index is not part of the name

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("hpu")

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        if self.fp16_supported is None:
            import habana_frameworks.torch.utils.experimental as htexp

            self.fp16_supported = htexp._is_fp16_supported()
        return self.fp16_supported

    def create_graph(self):
        return self.hpu.HPUGraph()

    def capture_to_graph(self, graph, pool: object = None, stream: object = None):
        return self.hpu.graph(graph, stream=stream)

    def lazy_call(self, callback):
        callback()

    def total_memory(self, device_index: int | None = None) -> int:
        return self.memory_stats(device_index)["Limit"]

    def available_memory(self, device_index: int | None = None) -> int:
        return self.total_memory(device_index) - self.memory_allocated(device_index)
