"""Where a flat ZeRO partition's optimizer state lives (stages 0-2): on the training device or on the host.

A stage strategy owns the layout (flat groups, partitions, buckets, collectives) and asks its store for the
rest: the masters, the gradient buffers the step reads, each gradient's squared sum, the update, and the
value of this rank's partition that the all-gather publishes. Masters and their gradients are fp32, or bf16
with ``bf16.bf16_master_weights_and_grads`` (the precision strategy's ``master_dtype``; device only), or fp16 with
``fp16.fp16_master_weights_and_grads`` (host only: ZeRO-Offload with DeepSpeed's CPU Adam, whose moments stay fp32).
``zero_optimization.offload_optimizer`` picks the store (:func:`flat_store`); the strategy never branches on it.

* :class:`DeviceFlatStore`: masters and gradients on the device, ``optimizer.step()``. With bf16 masters of a
  bf16 model the reduced partitions are the step's gradients themselves (no copy) and the master is gathered
  as it is (no cast).
* :class:`HostFlatStore` (``device: cpu``): masters, states and fp32 gradients on the host (pinned when an
  accelerator exists). The update runs on the compiled CPU optimizer tile by tile, each tile's gradient
  reaching the host while the previous one is updated (:class:`~.pipeline.StepPipeline`); with a 16-bit model
  the same pass writes the rounded partition (``update_tile(low_precision=...)``), which then goes to the
  device.
"""
from __future__ import annotations

from typing import Any

import torch

from dsrun.offload.pipeline import PipelineTimes, StepPipeline, tiled_cpu_step
from dsrun.offload.settings import (CPU_TILE_ELEMENTS, HostBuffers, OffloadContext, OffloadOptimizerSettings,
                                    require_cpu_optimizer, require_master_optimizer)


def chunked_square_sum(g: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a 16-bit ``g`` (float64, one element), squared in fp32 a chunk at a time."""
    sq = torch.zeros(1, dtype=torch.float64, device=g.device)
    for chunk in g.split(CPU_TILE_ELEMENTS):
        c = chunk.float()
        sq += torch.dot(c, c).double()
    return sq


class DeviceFlatStore:
    """Masters, gradients and optimizer states on the training device."""

    on_device = True  # each rank's whole local gradient can stay until the step (enable_backward_allreduce)

    def __init__(self, model_dtype: torch.dtype, device: torch.device, master_dtype: torch.dtype = torch.float32):
        self.model_dtype, self.device, self.master_dtype = model_dtype, device, master_dtype
        self.partition_dtypes: list[torch.dtype] = []  # the model's partitions' (fp32 where keep_in_fp32_modules)
        self.times: PipelineTimes | None = None  # the last update's tile pipeline (offloaded)

    def masters(self, partitions: list[torch.Tensor]) -> list[torch.nn.Parameter]:
        """Masters (copies in ``master_dtype``) of the model's ``partitions`` (views of its flat buffers on the
        device)."""
        self.partition_dtypes = [part.dtype for part in partitions]
        return [torch.nn.Parameter(part.detach().to(self.master_dtype).clone()) for part in partitions]

    def gradients(self, sizes: list[int], reduced: list[torch.Tensor] | None = None,
                  dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Gradient buffers of ``sizes`` elements in ``dtype`` (None: ``master_dtype``; another is
        ``data_types.grad_accum_dtype``'s); ``reduced`` (the partitions the reduction writes) serves itself when
        it is already in that dtype."""
        dtype = dtype or self.master_dtype
        if reduced is not None and all(part.dtype == dtype for part in reduced):
            return reduced
        return [torch.zeros(n, dtype=dtype, device=self.device) for n in sizes]

    def step_gradients(self, reduced: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the step reads, given the ``reduced`` partitions and this store's ``grads``."""
        if grads is not reduced:
            for grad, part in zip(grads, reduced):
                grad.copy_(part)
        return grads

    def square_sum(self, g: torch.Tensor) -> torch.Tensor:
        """Sum of squares of ``g`` (float64, one element)."""
        if g.dtype == torch.float32:  # flat: a dot product, no temporary
            return torch.dot(g, g).double()
        if g.dtype == self.master_dtype:  # bf16 master gradients: no fp32 copy of the whole partition either
            return chunked_square_sum(g)
        return torch.linalg.vector_norm(g, dtype=torch.float32).double().square()

    def update(self, optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter],
               grads: list[torch.Tensor], coef: float) -> None:
        """Scale ``grads`` by ``coef`` and step ``optimizer`` on ``masters``."""
        for master, g in zip(masters, grads):
            if coef != 1.0:
                g.mul_(coef)
            master.grad = g
        optimizer.step()

    def published(self, gi: int, master: torch.Tensor, world_size: int) -> torch.Tensor:
        """Partition ``gi``'s updated value in the model's dtype, on the device (the all-gather's input)."""
        dtype = self.partition_dtypes[gi]
        return master.detach() if dtype == master.dtype else master.detach().to(dtype)

    def loaded(self, masters: list[torch.nn.Parameter]) -> None:
        """The masters were loaded from a checkpoint (before they are published)."""

    def state_entries(self) -> dict[str, Any]:
        """State of this placement beyond the masters and the optimizer's, saved with them (ZenFlow's pending
        window, :mod:`.zenflow_store`); read before the masters are."""
        return {}

    def load_state_entries(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_entries` from a saved optimizer state (before :meth:`loaded`)."""

    def model_views(self) -> list[torch.Tensor]:
        """Views this store keeps of the model's flat buffers (they follow the buffers ``offload_states`` moves)."""
        return []

    def close(self) -> None:
        pass


class HostFlatStore(DeviceFlatStore):
    """``offload_optimizer.device: cpu``: masters, optimizer states and fp32 gradients in host memory."""

    on_device = False  # the step reads the reduced partition only

    def __init__(self, model_dtype: torch.dtype, device: torch.device, settings: OffloadOptimizerSettings,
                 optimizer: torch.optim.Optimizer, master_dtype: torch.dtype = torch.float32):
        super().__init__(model_dtype, device, master_dtype)
        self.settings = settings
        self.host = HostBuffers(settings)
        self.cpu_optimizer = require_cpu_optimizer(optimizer, settings)
        require_master_optimizer(self.cpu_optimizer, master_dtype)
        self.tile = max(1, min(settings.sub_group_size, CPU_TILE_ELEMENTS))
        self.pipeline = StepPipeline()
        self.times = PipelineTimes()
        self.direct_low_precision = device.type == "cpu"  # the kernel writes the model's partition itself
        self.partitions: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self._lp_staging: list[torch.Tensor] = []

    def masters(self, partitions: list[torch.Tensor]) -> list[torch.nn.Parameter]:
        self.partitions, self.partition_dtypes = partitions, [part.dtype for part in partitions]
        if self.model_dtype != self.master_dtype and not self.direct_low_precision:
            self._lp_staging = [self.host.empty(p.numel(), p.dtype) for p in partitions]
        masters = []
        for part in partitions:
            master = self.host.empty(part.numel(), self.master_dtype)
            master.copy_(part)
            masters.append(torch.nn.Parameter(master))
        return masters

    def gradients(self, sizes: list[int], reduced: list[torch.Tensor] | None = None,
                  dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        # the masters' dtype on the host (the config refuses another grad_accum_dtype with offload_optimizer)
        self.grads = [self.host.zeros(n, self.master_dtype) for n in sizes]
        return self.grads

    def step_gradients(self, reduced: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return reduced  # checked for overflow and measured where they are; copied tile by tile in the update

    def square_sum(self, g: torch.Tensor) -> torch.Tensor:
        if g.dtype == torch.float32:
            return super().square_sum(g)
        return chunked_square_sum(g)

    def _host_grad(self, source: list[torch.Tensor], gi: int, a: int, b: int, coef: float) -> torch.Tensor:
        """The host gradient (the masters' dtype) of elements [a, b) of partition gi, scaled by ``coef``."""
        tile = self.grads[gi][a:b]
        if source[gi] is not self.grads[gi]:
            tile.copy_(source[gi][a:b])
        if coef != 1.0:
            tile.mul_(coef)
        return tile

    def update(self, optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter],
               grads: list[torch.Tensor], coef: float) -> None:
        if self.cpu_optimizer is None:  # zero_force_ds_cpu_optimizer: false: another optimizer, on the host
            for gi, master in enumerate(masters):
                master.grad = self._host_grad(grads, gi, 0, master.numel(), coef)
            optimizer.step()
            for part, master in zip(self.partitions, masters):
                part.copy_(master.detach())
            return
        # fp32, or fp16 masters of an fp16 model (per partition: keep_in_fp32_modules' are fp32)
        same_dtype = [dtype == self.master_dtype for dtype in self.partition_dtypes]

        def low(u: int, gi: int, a: int, b: int) -> torch.Tensor | None:
            if same_dtype[gi]:
                return None
            return (self.partitions[gi] if self.direct_low_precision else self._lp_staging[gi])[a:b]

        def store(u: int, gi: int, a: int, b: int) -> None:
            if same_dtype[gi]:
                self.partitions[gi][a:b].copy_(masters[gi].detach()[a:b], non_blocking=True)
            elif not self.direct_low_precision:
                self.partitions[gi][a:b].copy_(self._lp_staging[gi][a:b], non_blocking=True)

        jobs = [(optimizer.param_groups[gi], master) for gi, master in enumerate(masters)]
        self.times = tiled_cpu_step(self.pipeline, self.cpu_optimizer, jobs, self.tile,
                                    lambda u, gi, a, b: self._host_grad(grads, gi, a, b, coef), low, store)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def published(self, gi: int, master: torch.Tensor, world_size: int) -> torch.Tensor:
        # the update already wrote this rank's 16-bit (or fp32) partition into the model's flat buffer; the
        # all-gather needs it as a separate input (one rank: nothing to gather, the buffer is already right)
        return self.partitions[gi] if world_size == 1 else self.partitions[gi].clone()

    def model_views(self) -> list[torch.Tensor]:
        return list(self.partitions)  # this rank's partition of each flat buffer, which the update writes

    def loaded(self, masters: list[torch.nn.Parameter]) -> None:
        with torch.no_grad():  # the publish gathers the device partitions: bring them up to the masters
            for part, master in zip(self.partitions, masters):
                part.copy_(master.detach())

    def close(self) -> None:
        self.pipeline.close()
        self.host.release()


def flat_store(ctx: OffloadContext) -> DeviceFlatStore:
    """The store ``ctx.zero_config.offload_optimizer`` asks for (``ctx``: the strategy's context)."""
    settings = OffloadOptimizerSettings.from_context(ctx)
    model_dtype = ctx.precision.model_dtype
    if settings is None:
        return DeviceFlatStore(model_dtype, ctx.device, ctx.precision.master_dtype)
    return HostFlatStore(model_dtype, ctx.device, settings, ctx.optimizer, ctx.precision.master_dtype)
