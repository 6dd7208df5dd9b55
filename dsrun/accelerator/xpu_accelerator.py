"""``deepspeed.accelerator.xpu_accelerator``: Intel GPUs through ``torch.xpu``, ranks over XCCL (oneCCL's
``ccl`` when ``oneccl_bindings_for_pytorch`` is installed)."""
from __future__ import annotations

import importlib.util

from dsrun.accelerator.device import Accelerator


class XPU_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's name
    visible_envs = ("ZE_AFFINITY_MASK",)

    def __init__(self) -> None:
        super().__init__("xpu")
        oneccl = importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None
        self._communication_backend_name = "ccl" if oneccl else "xccl"

    def is_bf16_supported(self) -> bool:
        return True

    def create_graph(self):
        return None  # DeepSpeed's XPU accelerator has no graphs: nothing to capture into

    def capture_to_graph(self, graph, pool: object = None, stream: object = None):
        import contextlib

        return contextlib.nullcontext()

    def lazy_call(self, callback):
        lazy = getattr(self.module, "_lazy_call", None)
        return lazy(callback) if lazy is not None else callback()
