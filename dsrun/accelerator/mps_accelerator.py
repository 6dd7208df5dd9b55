"""``deepspeed.accelerator.mps_accelerator``: Apple GPUs through ``torch.mps`` (torch 2.5 or newer), ranks over gloo.

MPS has one in-order command queue and no user-visible streams, events, graphs or device indices: work is
treated as synchronized, timers are the host's, and torch's pinning is not used. No fp64 on the device.
"""
from __future__ import annotations

import contextlib

import torch

from dsrun.accelerator.device import Accelerator


class MPS_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    backend = "gloo"

    def __init__(self) -> None:
        # ZeRO sizes its buffers with torch.mps's memory queries (torch 2.5): refuse an older torch here
        if getattr(getattr(torch, "mps", None), "recommended_max_memory", None) is None:
            raise ValueError("MPS_Accelerator requires torch>=2.5 (this torch has no torch.mps.recommended_max_memory)")
        super().__init__("mps")

    def is_synchronized_device(self) -> bool:
        return True

    def is_available(self) -> bool:
        return torch.backends.mps.is_available()

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("mps", 0)

    def set_device(self, device_index: int) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device_index: int | None = None) -> None:
        torch.mps.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.mps.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return None

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return None

    def Event(self, **kwargs):  # noqa: N802 - DeepSpeed's name
        return None

    def current_stream(self, device_index: int | None = None):
        return None

    def default_stream(self, device_index: int | None = None):
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool: object = None, stream: object = None):
        return contextlib.nullcontext()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.mps.current_allocated_memory()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.mps.driver_allocated_memory()

    max_memory_allocated = memory_allocated  # torch.mps keeps no peaks
    max_memory_reserved = memory_cached = max_memory_cached = memory_reserved

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        pass

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: int | None = None) -> dict:
        return {"allocated_bytes.all.current": self.memory_allocated(), "reserved_bytes.all.current":
                self.memory_reserved()}

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.mps.recommended_max_memory()

    def available_memory(self, device_index: int | None = None) -> int:
        return self.total_memory() - torch.mps.driver_allocated_memory()

    def pin_memory_enabled(self) -> bool:
        return False

    def is_bf16_supported(self) -> bool:
        return self.is_available() and torch.backends.mps.is_macos_or_newer(14, 0)

    def is_fp64_supported(self) -> bool:
        return False

    def range_push(self, msg: str, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def lazy_call(self, callback):
        return callback()
