"""``deepspeed.accelerator.abstract_accelerator``: DeepSpeed's accelerator interface, ``DeepSpeedAccelerator``.

Every accelerator class (``cpu_accelerator.CPU_Accelerator``, ``cuda_accelerator.CUDA_Accelerator``, ...) derives
from it; a class that leaves one of these methods out cannot be instantiated, which is what DeepSpeed's
``test_abstract_methods_defined`` checks. ``set_accelerator`` accepts only its instances.
"""
from __future__ import annotations

import abc


class DeepSpeedAccelerator(abc.ABC):
    """The methods an accelerator must answer (DeepSpeed's names and arguments); the defaults below are the ones
    DeepSpeed gives every accelerator."""

    supports_nvtx_domain = False

    # how work is ordered
    @abc.abstractmethod
    def is_synchronized_device(self): ...

    @abc.abstractmethod
    def use_host_timers(self): ...

    @abc.abstractmethod
    def resolves_data_dependency(self): ...

    @abc.abstractmethod
    def handles_memory_backpressure(self): ...

    # devices
    @abc.abstractmethod
    def device_name(self, device_index=None): ...

    @abc.abstractmethod
    def device(self, device_index=None): ...

    @abc.abstractmethod
    def set_device(self, device_index): ...

    @abc.abstractmethod
    def current_device(self): ...

    @abc.abstractmethod
    def current_device_name(self): ...

    @abc.abstractmethod
    def device_count(self): ...

    @abc.abstractmethod
    def synchronize(self, device_index=None): ...

    # random numbers
    @abc.abstractmethod
    def random(self): ...

    @abc.abstractmethod
    def set_rng_state(self, new_state, device_index=None): ...

    @abc.abstractmethod
    def get_rng_state(self, device_index=None): ...

    @abc.abstractmethod
    def manual_seed(self, seed): ...

    @abc.abstractmethod
    def manual_seed_all(self, seed): ...

    @abc.abstractmethod
    def initial_seed(self): ...

    @abc.abstractmethod
    def default_generator(self, device_index): ...

    # streams and events
    @abc.abstractmethod
    def Stream(self): ...  # noqa: N802 - DeepSpeed's name

    @abc.abstractmethod
    def stream(self, stream): ...

    @abc.abstractmethod
    def current_stream(self, device_index=None): ...

    @abc.abstractmethod
    def default_stream(self, device_index=None): ...

    @abc.abstractmethod
    def Event(self): ...  # noqa: N802 - DeepSpeed's name

    # memory
    @abc.abstractmethod
    def empty_cache(self): ...

    @abc.abstractmethod
    def memory_allocated(self, device_index=None): ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index=None): ...

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index=None): ...

    @abc.abstractmethod
    def memory_cached(self, device_index=None): ...

    @abc.abstractmethod
    def max_memory_cached(self, device_index=None): ...

    @abc.abstractmethod
    def reset_max_memory_cached(self, device_index=None): ...

    @abc.abstractmethod
    def memory_stats(self, device_index=None): ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index=None): ...

    @abc.abstractmethod
    def memory_reserved(self, device_index=None): ...

    @abc.abstractmethod
    def max_memory_reserved(self, device_index=None): ...

    @abc.abstractmethod
    def total_memory(self, device_index=None): ...

    @abc.abstractmethod
    def available_memory(self, device_index=None): ...

    # data types
    @abc.abstractmethod
    def is_bf16_supported(self): ...

    @abc.abstractmethod
    def is_fp16_supported(self): ...

    def is_fp64_supported(self) -> bool:
        return True

    @abc.abstractmethod
    def supported_dtypes(self): ...

    # misc
    @abc.abstractmethod
    def is_available(self): ...

    @abc.abstractmethod
    def range_push(self, msg, domain=None, category=None): ...

    @abc.abstractmethod
    def range_pop(self, domain=None): ...

    @abc.abstractmethod
    def lazy_call(self, callback): ...

    @abc.abstractmethod
    def communication_backend_name(self): ...

    @abc.abstractmethod
    def is_triton_supported(self): ...

    def prefer_triton_grouped_mm(self) -> bool:
        """Whether fused MoE experts should take a Triton grouped GEMM over ``torch._grouped_mm``: no, unless an
        accelerator says so."""
        return False

    # graphs
    def is_current_stream_capturing(self) -> bool:
        return False

    @abc.abstractmethod
    def create_graph(self): ...

    @abc.abstractmethod
    def capture_to_graph(self, graph, pool=None, stream=None): ...

    @abc.abstractmethod
    def replay_graph(self, graph): ...

    # tensor constructors on the device
    @abc.abstractmethod
    def BFloat16Tensor(self): ...  # noqa: N802 - DeepSpeed's name

    @abc.abstractmethod
    def ByteTensor(self): ...  # noqa: N802

    @abc.abstractmethod
    def DoubleTensor(self): ...  # noqa: N802

    @abc.abstractmethod
    def FloatTensor(self): ...  # noqa: N802

    @abc.abstractmethod
    def HalfTensor(self): ...  # noqa: N802

    @abc.abstractmethod
    def IntTensor(self): ...  # noqa: N802

    @abc.abstractmethod
    def LongTensor(self): ...  # noqa: N802

    # host memory registration (DeepSpeed's defaults: nothing to register)
    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        return False

    def unregister_host_memory(self, address: int) -> None:
        return None

    def pin_memory_alignment(self) -> int:
        return 1

    @abc.abstractmethod
    def on_accelerator(self, tensor): ...

    # ops and launching
    @abc.abstractmethod
    def op_builder_dir(self): ...

    @abc.abstractmethod
    def create_op_builder(self, class_name): ...

    @abc.abstractmethod
    def get_op_builder(self, class_name): ...

    @abc.abstractmethod
    def build_extension(self): ...

    @abc.abstractmethod
    def export_envs(self): ...

    @abc.abstractmethod
    def visible_devices_envs(self): ...

    @abc.abstractmethod
    def set_visible_devices_envs(self, current_env, local_accelerator_ids): ...

    @abc.abstractmethod
    def get_compile_backend(self): ...

    @abc.abstractmethod
    def set_compile_backend(self, backend): ...
