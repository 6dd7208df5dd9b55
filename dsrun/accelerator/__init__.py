"""The accelerator layer: which device, which communication backend, whether to pin host memory.

One small object answers the device questions the rest of dsrun would otherwise branch on: CPU ranks talk
over gloo, CUDA ranks over NCCL, and only CUDA benefits from pinned host buffers. Everything else in the
engine is written once against this interface.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from dsrun.utils.pin_memory import get_active_native_pinned_memory
from dsrun.utils.pin_memory_tracker import track_pinned_memory


@dataclass(unsafe_hash=True)
class Accelerator:
    """A device family (``cpu`` or ``cuda``) and the choices that follow from it. Not frozen, as DeepSpeed's
    accelerators are not: a test may patch a method of the process's accelerator (``monkeypatch.setattr``)."""

    name: str

    def device_name(self, index: int | None = None) -> str:
        """``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``."""
        if self.name == "cpu" or index is None:
            return self.name
        return f"{self.name}:{index}"

    def device(self, local_rank: int | None = None) -> torch.device:
        """The torch device this rank computes on."""
        if self.name == "cuda":
            index = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
            return torch.device("cuda", index)
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank)

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: NCCL for CUDA, gloo for CPU."""
        return "nccl" if self.name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return self.name == "cpu" or torch.cuda.is_available()

    def synchronize(self) -> None:
        """Wait for queued device work; timers call this so they measure work, not launches."""
        if self.name == "cuda":
            torch.cuda.synchronize()

    def pin_memory_enabled(self) -> bool:
        """Pinned host memory only speeds up host-to-CUDA copies; on CPU it is pointless."""
        return self.name == "cuda"

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """``tensor`` in pinned host memory where that helps (counted by :mod:`dsrun.utils.pin_memory_tracker`,
        as DeepSpeed's accelerators count), else ``tensor`` itself. With ``DS_PIN_MEMORY_BACKEND=native``, on
        any device, a page-locked copy from DeepSpeed's native manager (``dsrun/utils/pin_memory.py``;
        ``make_copy``/``match_shape`` as there)."""
        pins = get_active_native_pinned_memory()
        if pins is not None:
            track_pinned_memory(tensor.nbytes)
            return pins.pin(tensor, make_copy=make_copy, match_shape=match_shape)
        if not self.pin_memory_enabled():
            return tensor
        pinned = tensor.pin_memory()
        track_pinned_memory(pinned.nbytes)
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Page-locked by the native manager (when active) or by torch."""
        pins = get_active_native_pinned_memory()
        if pins is not None and pins.is_pinned(tensor):
            return True
        return self.name == "cuda" and tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> bool | None:
        """Release a native pin now (True if the tensor was pinned by it); None with torch's pinning, which is
        released with the tensor."""
        pins = get_active_native_pinned_memory()
        return pins.unpin(tensor) if pins is not None else None

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.name == "cuda" else 0

    # --- DeepSpeed's accelerator interface (deepspeed.accelerator.get_accelerator()) -----------------------
    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated() if self.name == "cuda" else 0

    def reset_peak_memory_stats(self) -> None:
        if self.name == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        if self.name == "cuda":
            torch.cuda.empty_cache()

    def total_memory(self) -> int:
        """Bytes of device memory (DeepSpeed's name): the GPU's; on the CPU the host's physical memory."""
        if self.name == "cuda":
            return torch.cuda.mem_get_info()[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self) -> int:
        """Bytes free now (DeepSpeed's name): the GPU's free memory; on the CPU the host's ``MemAvailable``."""
        if self.name == "cuda":
            return torch.cuda.mem_get_info()[0]
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def device_count(self) -> int:
        """Devices on this node: the CUDA GPUs; on the CPU, as DeepSpeed's CPU accelerator, the node's rank
        count ``LOCAL_SIZE`` when a launcher set it (every rank is a CPU "device"), else 1."""
        if self.name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", "0")) or 1

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.name == "cuda" else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self.name == "cuda" else "cpu"

    def is_synchronized_device(self) -> bool:
        """True when work runs in program order (the CPU), so no synchronize() is needed."""
        return self.name == "cpu"

    def is_bf16_supported(self) -> bool:
        return self.name == "cpu" or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True  # CPU kernels for half exist in torch; CUDA has had fp16 since compute capability 5.3

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels run here: a CUDA device of compute capability 8.0 or newer (DeepSpeed's test)."""
        return self.name == "cuda" and torch.cuda.get_device_capability()[0] >= 8

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32] + [t for t, ok in ((torch.bfloat16, self.is_bf16_supported()),
                                                  (torch.float16, self.is_fp16_supported())) if ok]

    def manual_seed(self, seed: int) -> None:
        if self.name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self.name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self.name == "cuda" else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self.name == "cuda":
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self.name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.name

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        """A CUDA stream; on the CPU None, since work is ordered (use ``is_synchronized_device()``)."""
        return torch.cuda.Stream(*args, **kwargs) if self.name == "cuda" else None

    def Event(self, **kwargs):  # noqa: N802 - DeepSpeed's name
        """A CUDA event; on the CPU None (there is no asynchronous work to mark)."""
        return torch.cuda.Event(**kwargs) if self.name == "cuda" else None

    def current_stream(self, device_index: int | None = None):
        """The CUDA stream work is queued on now; on the CPU None (DeepSpeed's CPU accelerator's answer)."""
        return torch.cuda.current_stream(device_index) if self.name == "cuda" else None

    def default_stream(self, device_index: int | None = None):
        """The device's default CUDA stream; on the CPU None."""
        return torch.cuda.default_stream(device_index) if self.name == "cuda" else None

    def stream(self, stream):
        """A context that queues work on ``stream`` (CUDA); on the CPU, or for ``None``, a context that does
        nothing."""
        if self.name == "cuda" and stream is not None:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def create_graph(self) -> "torch.cuda.CUDAGraph":
        """A CUDA graph to capture into; on the CPU a RuntimeError (there are no graphs to replay)."""
        if self.name != "cuda":
            raise RuntimeError("CUDA graphs need the CUDA accelerator; this process runs on the CPU")
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: "torch.cuda.CUDAGraph", pool: object = None, stream: object = None):
        """The context that records the work it runs into ``graph`` (``torch.cuda.graph``)."""
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: "torch.cuda.CUDAGraph") -> None:
        graph.replay()


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator for this process: ``DSRUN_ACCELERATOR`` (cpu|cuda) if set, else CUDA when present."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        wanted = os.environ.get("DSRUN_ACCELERATOR", "").strip().lower()
        if wanted not in ("", "cpu", "cuda"):
            from dsrun.utils.errors import UserError

            raise UserError(f"DSRUN_ACCELERATOR: got {wanted!r}; allowed: cpu, cuda")
        if not wanted:
            wanted = "cuda" if torch.cuda.is_available() else "cpu"
        _ACCELERATOR = Accelerator(wanted)
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that the detected accelerator is one it supports: dsrun supports cpu and cuda."""
    return get_accelerator().name in ("cpu", "cuda")


def set_accelerator(accelerator: Accelerator | str) -> None:
    """Override the detected accelerator (tests, or forcing CPU on a GPU machine)."""
    global _ACCELERATOR
    _ACCELERATOR = accelerator if isinstance(accelerator, Accelerator) else Accelerator(accelerator)
