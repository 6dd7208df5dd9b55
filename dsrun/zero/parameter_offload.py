"""ZeRO-3's parameter side, DeepSpeed's ``runtime.zero.parameter_offload``: :class:`DeepSpeedZeRoOffload`, and the
names scripts take from that module for a module's parameter dict.

* :class:`DeepSpeedZeRoOffload` partitions a model's parameters and gathers them around its modules' passes (the
  :class:`~.hooks.ParameterCoordinator`, or :class:`~.whole_params.WholeParameters` where every partition group is
  one rank), with ``offload_param``'s shards in host memory or NVMe files. The stage-3 strategy holds one beside its
  gradient buckets and optimizer stores, as DeepSpeed's stage-3 optimizer does; an engine built at stage 3 with no
  optimizer holds one by itself (ZeRO-Inference: :meth:`DeepSpeedZeRoOffload.for_inference`), as DeepSpeed's
  engine does then: each forward of the root module starts a pass (the first forward-only pass is the recorded
  order the next ones prefetch along), and a gradient reaching a parameter is refused with one line, there
  being no optimizer to take it.
* :data:`ZeROOrderedDict` is :class:`dsrun.zero.hooks.GatheringParameters`: the ``_parameters`` of every module
  holding partitioned parameters once a ZeRO-3 engine hooks the model, which gathers a partitioned parameter
  read inside a forward and makes it an external parameter of the module running.
* :func:`ensure_zero_ordered_dict` wraps a module's plain ``_parameters`` in one (idempotent). A dict made so
  gathers nothing until a coordinator adopts it: dsrun's hook the modules a model held when the engine was built.
* :func:`print_rank_0` is the trace line a read inside DeepCompile's ZeRO-3 eager fallback writes
  (:mod:`dsrun.compile.z3_eager_fallback`): printed on rank 0 with ``force=True``, else logged at debug level.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from dsrun.offload import param_swapper
from dsrun.precision.keep_fp32 import is_kept
from dsrun.utils.leaf_modules import apply_zero_leaf_module_config, set_z3_leaf_modules_by_threshold
from dsrun.utils.logging import log_dist, logger
from dsrun import comm
from dsrun.zero import coalesced_gather, quantized_shards
from dsrun.zero.hooks import GatheringParameters, ParameterCoordinator
from dsrun.zero.module_gathers import gathered_together, iter_unique_params
from dsrun.zero.memory import MemoryBreakdown
from dsrun.zero.partition_params import is_zero_param, partition_param, shard_padding
from dsrun.zero.partitioner_internals import enable_memory_efficient_linear
from dsrun.zero.sharding import ShardingPolicy
from dsrun.zero.whole_params import WholeParameters, keeps_whole

if TYPE_CHECKING:
    from dsrun.zero.base import StrategyContext

__all__ = ["DeepSpeedZeRoOffload", "ZeROOrderedDict", "ensure_zero_ordered_dict", "print_rank_0"]

ZeROOrderedDict = GatheringParameters

NO_OPTIMIZER = ("a ZeRO-3 engine built without an optimizer (ZeRO-Inference: forward and generate only); pass "
                "optimizer= to deepspeed.initialize or add an \"optimizer\" section to train")
NO_OPTIMIZER_BACKWARD = "a gradient reached a parameter of " + NO_OPTIMIZER
NO_OPTIMIZER_STEP = "step() on " + NO_OPTIMIZER


class DeepSpeedZeRoOffload:
    """The parameters of ``ctx.module`` partitioned over the sharding policy's groups (those built under
    ``zero.Init`` already are: their shards brought to the engine's device and dtype), the config's leaf modules
    marked, small ones kept gathered (``stage3_param_persistence_threshold``), ``offload_param``'s shards placed,
    and the coordinator that gathers them (``coordinator``). Once the caller has placed the shards for good (the
    strategy's stores view fp32 ones), :meth:`keep_whole` points parameters kept whole at them."""

    gather_state_dict: Callable[..., dict[str, torch.Tensor]] | None = None  # ZeRO-Inference's 16-bit exports

    def __init__(self, ctx: StrategyContext):
        zc = ctx.zero_config
        self.ctx = ctx
        self.model_dtype = ctx.precision.model_dtype
        # the config's leaf modules (leaf_module, stage3_module_granularity_threshold), before anything is hooked
        leaf = zc.leaf_module
        apply_zero_leaf_module_config(ctx.module, leaf.classes, leaf.names, leaf.name_suffixes)
        if zc.stage3_module_granularity_threshold > 0:
            set_z3_leaf_modules_by_threshold(ctx.module, int(zc.stage3_module_granularity_threshold))
        if zc.memory_efficient_linear:
            enable_memory_efficient_linear()
        self.params = iter_unique_params([ctx.module])
        # which group each parameter is partitioned over and how it is gathered and reduced: a feature's policy
        # (ZeRO++/MiCS/hpZ: dsrun/zero/zeropp.py) or plain ZeRO-3's
        self.sharding: ShardingPolicy = ctx.sharding if ctx.sharding is not None else ShardingPolicy(ctx.groups,
                                                                                                      ctx.group)
        self._partition_all()
        for p in self.params:  # enable_sanity_checks: GatheredParameters checks for changes it would lose
            p.ds_enable_sanity_checks = bool(zc.enable_sanity_checks)
        self._mark_persistent(int(zc.stage3_param_persistence_threshold), int(zc.stage3_model_persistence_threshold))
        self.sharding.prepare(self.params)  # quantized gathers and reduce-scatter (ZeRO++)
        # offload_param: shards to host memory or NVMe files (dsrun/offload/param_swapper.py)
        self.param_offload = param_swapper.attach_param_offload(
            self.params, zc.offload_param, ctx.device, self.model_dtype, aio_config=ctx.aio_config, rank=ctx.rank,
            gathered_together=gathered_together(ctx.module))
        # every parameter partitioned over a group of one: kept whole, no hooks (dsrun/zero/whole_params.py)
        self.keeps_whole = keeps_whole(self.params, self.param_offload)
        self.coordinator: ParameterCoordinator | WholeParameters = WholeParameters(ctx.module, self.params) \
            if self.keeps_whole else ParameterCoordinator(
                ctx.module, prefetch_bucket_size=int(zc.stage3_prefetch_bucket_size),
                max_live_parameters=int(zc.stage3_max_live_parameters), max_reuse_distance=int(zc.stage3_max_reuse_distance),
                log_trace_cache_warnings=bool(zc.log_trace_cache_warnings), all_reduce=bool(zc.stage3_use_all_reduce_for_fetch_params),
                coalesced=coalesced_gather.coalesces(zc.stage3_allgather_sequential, ctx.device))
        if self.param_offload is not None:
            self.coordinator.after_fetch = self.param_offload.after_fetch
        self._inference_hooks: list[Any] = []

    @classmethod
    def for_inference(cls, ctx: StrategyContext, gather_state_dict: Callable[..., dict[str, torch.Tensor]]
                      ) -> "DeepSpeedZeRoOffload":
        """What an engine built at stage 3 without an optimizer holds (DeepSpeed's ``_configure_zero_optimizer``
        with ``optimizer=None``): every pass starts at the root module's forward, and gradients are refused.
        ``gather_state_dict(module, exclude_frozen_parameters=...)`` gathers the module for its 16-bit exports
        (:func:`dsrun.zero.gathered.full_state_dict`, handed in: that module imports this one)."""
        log_dist("Creating ZeRO Offload", ranks=[0])
        offload = cls(ctx)
        offload.gather_state_dict = gather_state_dict
        offload.keep_whole()
        # before the coordinator's own root hook, which records the root as running
        offload._inference_hooks.append(ctx.module.register_forward_pre_hook(offload._start_pass, prepend=True))
        offload._inference_hooks += [p.register_post_accumulate_grad_hook(_refuse_gradient)
                                     for p in offload.params if p.requires_grad]
        return offload

    def step(self, *args: object, **kwargs: object) -> None:
        """Refused: ZeRO-Inference's holder is ``engine.optimizer`` (as DeepSpeed's engine sets it), but there is no
        optimizer to step (DeepSpeed's object has no ``step``)."""
        raise RuntimeError(NO_OPTIMIZER_STEP)

    def _start_pass(self, module: torch.nn.Module, inputs: object) -> None:
        """DeepSpeed's ``reset_step`` at the root's forward: a pass that had no backward (inference) finished at
        the next one's start; its order, recorded, is what the next ones prefetch along (while the coordinator's
        hooks are lifted, ``unwrap_model_for_generation``, neither boundary releases or records anything)."""
        self.coordinator.end_backward()
        self.coordinator.begin_forward()

    # --- construction -------------------------------------------------------------------------------------
    def _partition_all(self) -> None:
        """Partition every parameter (those built under ``zero.Init`` already are: bring their shards to the
        engine's device and dtype)."""
        device, wanted = self.ctx.device, self.ctx.zero_config.offload_param.device
        for p in self.params:
            floating = p.is_floating_point() or (is_zero_param(p) and p.ds_tensor.is_floating_point())
            dtype = (torch.float32 if is_kept(p) else self.model_dtype) if floating else None  # keep_in_fp32_modules
            if is_zero_param(p):
                owner = param_swapper.offload_of(p)
                if owner is not None:  # built under zero.Init(remote_device=...): its shard is offloaded
                    if owner.device == wanted and (dtype is None or p.ds_tensor.dtype == dtype):
                        continue
                    owner.release(p)  # elsewhere or another dtype: bring it back, offload again later
                    if not owner.params:
                        owner.close()
                if (dtype is not None and p.ds_tensor.dtype != dtype) or p.ds_tensor.device != device:
                    p.ds_tensor = p.ds_tensor.to(device=device, dtype=dtype or p.ds_tensor.dtype)
                    p.data = torch.empty(0, dtype=p.ds_tensor.dtype, device=device)
                continue
            # MoE experts are partitioned over their expert-data-parallel group, everything else over the
            # policy's shard group (the data group; with MiCS this rank's shard group)
            partition_param(p, self.sharding.group_of(p), dtype=dtype, device=device)
        for p in self.params:
            self.sharding.attach(p)

    def _mark_persistent(self, threshold: int, model_threshold: int) -> None:
        budget = model_threshold
        for p in self.params:
            if p.ds_numel < threshold and p.ds_numel <= budget:
                p.ds_persist = True
                budget -= p.ds_numel

    # --- what its holder calls ----------------------------------------------------------------------------
    def keep_whole(self) -> None:
        """Parameters kept whole (a partition group of one) point at their shards, now placed."""
        if self.keeps_whole:
            self.coordinator.keep_whole()

    def empty_partition_cache(self) -> None:
        """Release every gathered parameter, persistent ones included (``engine.empty_partition_cache()``)."""
        self.coordinator.invalidate()

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """The full model state dict (collective); None when ``stage3_gather_16bit_weights_on_model_save`` is off."""
        if not self.ctx.zero_config.stage3_gather_16bit_weights_on_model_save:
            return None
        return self.full_16bit_state_dict(exclude_frozen_parameters)

    def full_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter gathered (collective; every rank gets it)."""
        return self.gather_state_dict(self.ctx.module, exclude_frozen_parameters=exclude_frozen_parameters)

    def memory_breakdown(self) -> MemoryBreakdown:
        """Without an optimizer: this rank's shards plus the full copies of persistent parameters, their padding,
        and the gather and offload buffers; no gradients, masters or optimizer states."""
        shards = sum(quantized_shards.stored_bytes(p) for p in self.params) + self.sharding.secondary_bytes(self.params)
        persistent = sum(p.ds_numel * p.ds_tensor.element_size() for p in self.params if p.ds_persist)
        padding = sum(shard_padding(p, comm.get_rank(p.ds_process_group))  # MoE experts: their group's rank
                      * (1 if quantized_shards.message_of(p) is not None else p.ds_tensor.element_size())  # INT8 codes
                      for p in self.params)
        pool = self.param_offload.buffer_bytes() if self.param_offload is not None else 0
        return MemoryBreakdown(parameters=shards + persistent, gradients=0, master_weights=0, optimizer_states=0,
                               padding=int(padding), buffers=pool + self.coordinator.buffer_pool.nbytes)

    def close(self) -> None:
        """Hooks off (the coordinator's and, for inference, its own), offloaded shards' files and buffers given back."""
        for handle in self._inference_hooks:
            handle.remove()
        self._inference_hooks = []
        self.coordinator.remove_hooks()
        if self.param_offload is not None:
            self.param_offload.close()


def _refuse_gradient(param: torch.nn.Parameter) -> None:
    param.grad = None
    raise RuntimeError(NO_OPTIMIZER_BACKWARD)


def ensure_zero_ordered_dict(module: object) -> None:
    """Make ``module._parameters`` a :data:`ZeROOrderedDict` holding the same entries, unless it is one already,
    is missing or is not a dict. The container replaced is kept as ``module._original_parameters`` the first
    time only (a later wrap must not lose the torch-native one)."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params  # type: ignore[attr-defined]
    module._parameters = ZeROOrderedDict(module, params)  # type: ignore[attr-defined]


def print_rank_0(message: str, debug: bool = False, force: bool = False) -> None:
    """DeepSpeed's parameter-offload trace line: on rank 0 when ``debug`` or ``force``, else a debug log."""
    if debug or force:
        log_dist(message, ranks=[0])
    else:
        logger.debug(message)
