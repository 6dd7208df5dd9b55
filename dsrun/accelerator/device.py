"""``Accelerator``: DeepSpeed's accelerator interface answered by a torch device module.

A device family is one module of torch's (``torch.cuda``, ``torch.xpu``, or ``torch.npu``/``torch.mlu``/
``torch.sdaa``/``torch.supa``, which a vendor package such as ``torch_npu`` adds to torch) plus a few facts: its
collective backend, the variables that hide devices from a process, those a launcher passes on. Every method
here asks that module, as DeepSpeed's accelerators do; each ``*_accelerator.py`` class states its family's facts
and overrides what differs (the host, in ``cpu_accelerator.py``; MPS; HPU). Where a family's torch module is
absent (its package is not installed) ``is_available()`` is False and any device call raises a RuntimeError
naming the package, rather than an AttributeError from deep inside.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from dsrun.accelerator.abstract_accelerator import DeepSpeedAccelerator
from dsrun.utils.pin_memory import get_active_native_pinned_memory
from dsrun.utils.pin_memory_tracker import track_pinned_memory


class Accelerator(DeepSpeedAccelerator):
    """A device family named ``name`` and answered by ``torch.<torch_module>``; subclasses set the facts."""

    torch_module: str | None = None  # the attribute of torch that drives the device; None: the family's name
    package: str = ""  # what adds that module to torch, where torch itself does not ship it
    backend: str = "nccl"  # torch.distributed's backend for this device
    visible_envs: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)
    launcher_envs: tuple[str, ...] = ()  # prefixes of the variables a multi-node launcher passes on
    triton: bool = False  # whether Triton kernels run on the family at all
    compile_backend: str = "inductor"

    def __init__(self, name: str) -> None:
        self.name = name
        self._name = name  # DeepSpeed's attribute
        self._communication_backend_name = self.backend
        self._compile_backend = self.compile_backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash((type(self), self.name))

    @property
    def module(self):
        """``torch.<torch_module>``; a RuntimeError naming the package when it is not installed."""
        attribute = self.torch_module or self.name
        module = getattr(torch, attribute, None)
        if module is None:
            raise RuntimeError(f"{type(self).__name__} needs torch.{attribute}, which {self.package or 'torch'} "
                               f"provides and this installation lacks; use DS_ACCELERATOR=cpu or install it")
        return module

    # --- how work is ordered ------------------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        """False: device work is queued and runs after the call returns (call synchronize() to wait)."""
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # --- devices --------------------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` or ``"cuda:<index>"`` (the family's name)."""
        return self.name if device_index is None else f"{self.name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        """The torch device this rank computes on: ``device_index``, else the launcher's ``LOCAL_RANK``."""
        index = device_index if device_index is not None else int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(self.name, index)

    def set_device(self, device_index: int) -> None:
        self.module.set_device(device_index)

    def current_device(self) -> int:
        return self.module.current_device()

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def device_count(self) -> int:
        return self.module.device_count()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        module = getattr(torch, self.torch_module or self.name, None)
        return module is not None and module.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for queued device work; timers call this so they measure work, not launches."""
        self.module.synchronize(device_index)

    # --- random numbers -------------------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.module.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return self.module.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self.module.get_rng_state(device_index if device_index is not None else self.name)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        self.module.set_rng_state(new_state, device_index if device_index is not None else self.name)

    def default_generator(self, device_index: int) -> torch.Generator:
        return self.module.default_generators[device_index]

    # --- streams, events, graphs ----------------------------------------------------------------------------
    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        """A new stream of the device (DeepSpeed's ``Stream()``)."""
        return self.module.Stream(*args, **kwargs)

    def Event(self, **kwargs):  # noqa: N802 - DeepSpeed's name
        return self.module.Event(**kwargs)

    def current_stream(self, device_index: int | None = None):
        return self.module.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return self.module.default_stream(device_index)

    def stream(self, stream):
        """A context that queues work on ``stream``; for ``None`` a context that does nothing."""
        return contextlib.nullcontext() if stream is None else self.module.stream(stream)

    def is_current_stream_capturing(self) -> bool:
        capturing = getattr(self.module, "is_current_stream_capturing", None)
        return bool(capturing()) if capturing is not None else False

    def create_graph(self):
        """A device graph to capture into (``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``, ...); a RuntimeError
        where the family has none."""
        graph = getattr(self.module, f"{self.name.upper()}Graph", None)
        if graph is None:
            raise RuntimeError(f"{type(self).__name__}: torch.{self.torch_module or self.name} has no device graphs")
        return graph()

    def capture_to_graph(self, graph, pool: object = None, stream: object = None):
        """The context that records the work it runs into ``graph``."""
        return self.module.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    # --- memory ---------------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        self.module.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self.module.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self.module.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.module.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self.module.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.module.max_memory_reserved(device_index)

    memory_cached = memory_reserved  # torch's older names for the caching allocator's reserve
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        return self.module.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.module.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        """Bytes of device memory."""
        return self.module.get_device_properties(device_index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes free now: the driver's count where torch asks it, else total minus what torch allocated."""
        if hasattr(self.module, "mem_get_info"):
            return self.module.mem_get_info(device_index)[0]
        return self.total_memory(device_index) - self.memory_allocated(device_index)

    # --- pinned host memory ---------------------------------------------------------------------------------
    def pin_memory_enabled(self) -> bool:
        """Whether torch's pinning page-locks host memory for this device (it speeds host-to-device copies)."""
        return True

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
        return self.pin_memory_enabled() and tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> bool | None:
        """Release a native pin now (True if the tensor was pinned by it); None with torch's pinning, which is
        released with the tensor."""
        pins = get_active_native_pinned_memory()
        return pins.unpin(tensor) if pins is not None else None

    # --- data types -----------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        """The device's answer; True where no device is present to ask (DeepSpeed's CUDA answer then)."""
        return not self.is_available() or self.module.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32] + [t for t, ok in ((torch.float16, self.is_fp16_supported()),
                                                  (torch.bfloat16, self.is_bf16_supported())) if ok]

    def is_triton_supported(self) -> bool:
        return self.triton and self.is_available()

    def _tensor(self, dtype: torch.dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self.device_name())

    BFloat16Tensor = property(lambda self: self._tensor(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor(torch.float64))
    FloatTensor = property(lambda self: self._tensor(torch.float32))
    HalfTensor = property(lambda self: self._tensor(torch.float16))
    IntTensor = property(lambda self: self._tensor(torch.int32))
    LongTensor = property(lambda self: self._tensor(torch.int64))

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.name

    # --- profiling ranges, lazy initialisation --------------------------------------------------------------
    def range_push(self, msg: str, domain=None, category=None):
        nvtx = getattr(self.module, "nvtx", None)
        return nvtx.range_push(msg) if nvtx is not None else None

    def range_pop(self, domain=None):
        nvtx = getattr(self.module, "nvtx", None)
        return nvtx.range_pop() if nvtx is not None else None

    def lazy_call(self, callback):
        """Run ``callback`` once the device is initialised (at once if it is)."""
        return self.module._lazy_call(callback)

    # --- ops, launching, compiling --------------------------------------------------------------------------
    def op_builder_dir(self) -> str:
        """The package of op builders (DeepSpeed's ``deepspeed.ops.op_builder`` is dsrun's ``op_builder``)."""
        return "op_builder"

    def get_op_builder(self, class_name: str):
        """The builder class named ``class_name`` (``"CPUAdamBuilder"``, ...), None for a name with no builder."""
        import importlib

        builders = importlib.import_module(self.op_builder_dir())
        found = getattr(builders, class_name, None) if class_name.endswith("Builder") else None
        return found if isinstance(found, type) else None

    def create_op_builder(self, class_name: str):
        builder = self.get_op_builder(class_name)
        return builder() if builder is not None else None

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    def export_envs(self) -> list[str]:
        return list(self.launcher_envs)

    def visible_devices_envs(self) -> list[str]:
        return list(self.visible_envs)

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        """Let a rank see only ``local_accelerator_ids`` (written into ``current_env``)."""
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Use ``backend`` for ``torch.compile``; ValueError naming the ones torch knows when it is not one."""
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported Backends are {known}")
        self._compile_backend = backend
