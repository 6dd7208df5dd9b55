"""``deepspeed.accelerator.cpu_accelerator``: the host as the device (ranks over gloo; ``set_accelerator(
CPU_Accelerator())`` forces it on a machine with a GPU).

Work runs in program order, so there are no streams, events or graphs to wait on (None, or a context that does
nothing), and torch's pinning is pointless (tensors come back as they are; the native backend still pins).
"""
from __future__ import annotations

import contextlib
import os

import torch

from dsrun.accelerator.device import Accelerator


class CPU_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    backend = "gloo"
    launcher_envs = ()

    def __init__(self) -> None:
        super().__init__("cpu")

    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """As DeepSpeed's CPU accelerator: the node's rank count ``LOCAL_SIZE`` when a launcher set it (every rank
        is a CPU "device"), else 1."""
        return int(os.environ.get("LOCAL_SIZE", "0")) or 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        """None: work is ordered (use ``is_synchronized_device()``)."""
        return None

    def Event(self, **kwargs):  # noqa: N802 - DeepSpeed's name
        return None

    def current_stream(self, device_index: int | None = None):
        return None

    def default_stream(self, device_index: int | None = None):
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def is_current_stream_capturing(self) -> bool:
        return False

    def create_graph(self):
        """A RuntimeError: there are no graphs to replay on the host."""
        raise RuntimeError("CUDA graphs need the CUDA accelerator; this process runs on the CPU")

    def capture_to_graph(self, graph, pool: object = None, stream: object = None):
        return contextlib.nullcontext()

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, device_index: int | None = None) -> int:
        """0: the host has no device allocator to count (the process's memory is not "allocated to a device")."""
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated
    memory_cached = max_memory_cached = memory_allocated

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        pass

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: int | None = None) -> dict:
        return {}

    def total_memory(self, device_index: int | None = None) -> int:
        """The host's physical memory."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        """The host's ``MemAvailable``."""
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory_enabled(self) -> bool:
        """Pinned host memory only speeds up host-to-device copies; on the CPU it is pointless."""
        return False

    def is_bf16_supported(self) -> bool:
        return True

    def range_push(self, msg: str, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def lazy_call(self, callback):
        return callback()
