"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned across the data-parallel ranks.

* **Parameters** are split one by one (:mod:`.partition_params`): rank r keeps ``ceil(numel / N)`` elements
  of each. :class:`~.hooks.ParameterCoordinator` all-gathers a submodule's parameters just before its
  forward and again before its backward, and releases them after use (prefetching along the recorded
  module order, keeping small ``stage3_param_persistence_threshold`` parameters gathered). Where every
  parameter is partitioned over a group of one rank (a world of one, MiCS shard groups of one) there is nothing
  to gather: they are kept whole, with no hooks (:mod:`.whole_params`), and the step costs what stage 0's does.
* **Gradients** never stay whole: a finished gradient (its post-accumulate hook; a ZeRO-3 leaf module's once
  backward is done, zero for an expert no token reached) goes into a bucket, the full copy dropped; a bucket of
  ``reduce_bucket_size`` elements is reduce-scattered (asynchronously with ``overlap_comm``) into each rank's fp32
  accumulator, every micro-step. On the CPU a bucket also goes whenever backward reaches another module (FSDP2's
  release; bit-identical), with glibc's mmap threshold pinned above one module's temporaries (:mod:`.host_memory`).
* **Optimizer**: each param group's shards lie end to end in fp32 *sub-groups* of at most ``sub_group_size``
  elements (one optimizer tensor each); the step updates these, then writes the model-dtype shards (with
  ``bf16.bf16_master_weights_and_grads`` the sub-groups and accumulators are bf16 and the shards views of them).
  No all-gather follows the step. Each sub-group lives in a store (:mod:`dsrun.offload.shard_store`: the device,
  or with ``offload_optimizer`` host memory or NVMe), which owns its master, gradient, update, checkpoint, bytes.

The *sharding policy* (:mod:`.sharding`; ZeRO++/MiCS/hpZ's: :mod:`.zeropp`) says which group each parameter is
partitioned over, how it is gathered, how a bucket is reduce-scattered and what a boundary adds.
``engine.offload_states()`` (:mod:`.offload_states`) moves each store's ``hp_params``, ``optim_states``,
``lp_grads``, the model's shards (``lp_params``) and frees the kept reduce-scatter buffers and gathered parameters.
Per step 3 * psi * (N - 1) / N elements move per rank (two gathers, one reduce-scatter), 1.5x stage 0's.
DeepCompile (``dsrun/compile``) takes the gathers and the reduction into the graph: :meth:`hand_over_to_compiler`;
its parameter offload (``compile.offload_parameters``) moves the shards to host buffers between their uses in the
graphs and sets :attr:`Stage3Strategy.recall_shards`, which brings them back where they must be on the device (the
masters the step updates, a gather of the whole model, ``offload_states``, a checkpoint's save and load).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable

import torch

from dsrun import comm
from dsrun.checkpoint.layout import CheckpointLayout, layout_for_stage
from dsrun.zero.base import StrategyContext, ZeroStrategy
from dsrun.zero.memory import MemoryBreakdown, optimizer_state_bytes
from dsrun.zero import host_memory, quantized_shards
from dsrun.zero.buckets import CompilerIntake, FlatBufferPool
from dsrun.zero.offload_states import StatesOffload
from dsrun.utils.leaf_modules import z3_leaf_parameter
from dsrun.zero.gathered import full_state_dict  # noqa: F401 - also served from here (dsrun.zero, tests)
from dsrun.zero.parameter_offload import DeepSpeedZeRoOffload
from dsrun.zero.partition_params import full_tensor, shard_padding
from dsrun.offload import param_swapper
from dsrun.precision.keep_fp32 import is_kept
from dsrun.offload.pipeline import PipelineTimes
from dsrun.offload.settings import OffloadOptimizerSettings
from dsrun.offload.shard_store import ShardContext, ShardPlacement, SubGroup
from dsrun.offload.state_moves import OffloadStateTypeEnum, StateTensor
from dsrun.optim.optimizer_wrappers import OptimizerWrapperKind


class Stage3Strategy(StatesOffload, ZeroStrategy):
    stage = 3
    scatters_gradients = True
    recall_shards: Callable[..., None] | None = None  # DeepCompile's parameter offload: shards back home

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        zc = ctx.zero_config
        self.reduce_bucket_numel = max(1, int(ctx.reduce_bucket_size))
        self.sub_group_size = max(1, int(zc.sub_group_size))
        self.gather_16bit_on_save = bool(zc.stage3_gather_16bit_weights_on_model_save)

        # the parameters partitioned, their gathers and offload: the parameter side, as DeepSpeed's stage-3
        # optimizer holds a DeepSpeedZeRoOffload (dsrun/zero/parameter_offload.py)
        self.parameter_offload = DeepSpeedZeRoOffload(ctx)
        self.params, self.sharding = self.parameter_offload.params, self.parameter_offload.sharding
        self.param_offload, self.keeps_whole = self.parameter_offload.param_offload, self.parameter_offload.keeps_whole
        self.coordinator = self.parameter_offload.coordinator
        self.norm_group = self.sharding.shard_group  # each shard's gradient is counted once in the norm
        # on the CPU every module's gradients are reduce-scattered once backward moves past it (as FSDP2 does),
        # so full gradients never pile up towards reduce_bucket_size, which stays the largest bucket (kept
        # whole, nothing is gathered: glibc's own threshold serves the temporaries, as at stage 0)
        self.reduce_per_module = ctx.device.type == "cpu" and not self.keeps_whole
        if self.reduce_per_module:
            self.coordinator.before_backward = self._reduce_finished_modules
            # 1 MiB, not above one module's temporaries: a higher pin kept their freed pages in the heap, about a
            # whole gathered model per rank under the step's peak (docs/performance.md, "The mmap pin")
            host_memory.fix_mmap_threshold()
            host_memory.cache_large_blocks(host_memory.HOST_CACHE_MODULES  # the temporaries recur module by module
                                           * self.coordinator.largest_fetch_numel() * self.model_dtype.itemsize)

        self._optimizer = ctx.optimizer
        self.shard_ctx = ShardContext(  # what the stores know of this strategy
            device=ctx.device, model_dtype=self.model_dtype, needs_master_weights=self.precision.needs_master_weights,
            measure_gradients=self.precision.checks_overflow or ctx.gradient_clipping > 0, rank=self.rank,
            master_dtype=self.precision.master_dtype, grad_dtype=getattr(ctx.accumulation, "dtype", None))
        self.placement = ShardPlacement(self.shard_ctx, ctx.optimizer, OffloadOptimizerSettings.from_context(ctx))
        self.sub_groups = self._build_sub_groups()
        for store in self.placement.stores:
            store.finish()
        self.parameter_offload.keep_whole()  # the shards are where the stores put them (fp32: views of the masters)
        self.sharding.check_gradient_stores(resident=all(sg.grad is not None for sg in self.sub_groups))
        self.masters = [sg.master for sg in self.sub_groups]
        if self._optimizer.state:
            self._optimizer.state.clear()  # state keyed by the old full parameters would never be used
        self._slot: dict[int, tuple[SubGroup, int]] = {}
        for sg in self.sub_groups:
            for p, off in zip(sg.params, sg.offsets):
                self._slot[id(p)] = (sg, off)
        # gradients waiting for a bucket, per group they are reduced over (experts: their expert-data group)
        self._pending: dict[tuple[int, bool], list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
        self._pending_numel: dict[tuple[int, bool], int] = {}  # (group, fp32-kept): those reduce in fp32
        # (work, output, [(param, offset)], input kept alive until the collective completes)
        self._inflight: list[tuple[Any, torch.Tensor, list[tuple[torch.nn.Parameter, int]], torch.Tensor]] = []
        self._armed = False
        self.max_buckets_in_flight = 2
        # flat buffers of finished buckets, reused by the next ones: at most max_buckets_in_flight + 1 of each kind
        self._bucket_pool = FlatBufferPool(self.comm_dtype, ctx.device, keep=2 * (self.max_buckets_in_flight + 1))
        # a leaf module's parameters (dsrun/utils/leaf_modules.py) are reduced once backward is done, each rank
        # giving a zero gradient for an expert its tokens skipped, so every rank reduces the same buckets
        trainable = [p for p in self.params if p.requires_grad and id(p) in self._slot]
        self._leaf_params = [p for p in trainable if z3_leaf_parameter(p)]
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                            for p in trainable if not z3_leaf_parameter(p)]

    # --- construction -------------------------------------------------------------------------------------
    def _build_sub_groups(self) -> list[SubGroup]:
        names = {id(p): n for n, p in self.ctx.module.named_parameters(remove_duplicate=True)}
        sub_groups: list[SubGroup] = []
        seen: set[int] = set()
        for gi, param_group in enumerate(self._optimizer.param_groups):
            current: SubGroup | None = None
            masters = []
            for p in sorted(param_group["params"], key=is_kept):  # keep_in_fp32_modules: fp32 in sub-groups apart
                if id(p) in seen or not p.requires_grad:
                    continue
                if id(p) not in names:
                    raise ValueError("ZeRO stage 3: the optimizer holds a parameter that is not part of the model")
                seen.add(id(p))
                if current is None or not current.takes(p, self.sub_group_size):
                    current = SubGroup(gi)
                    sub_groups.append(current)
                    masters.append(current)
                current.add(p)
            first = len(sub_groups) - len(masters)
            for k, sg in enumerate(masters):
                self._init_sub_group(first + k, sg)
            param_group["params"] = [sg.master for sg in masters]
        return sub_groups

    def _trainable_numel(self) -> int:
        seen, total = set(), 0
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    total += p.ds_partition_numel
        return total

    def _init_sub_group(self, index: int, sg: SubGroup) -> None:
        """Place sub-group ``index`` in its store, which gives it its fp32 master and gradient accumulator."""
        sg.index = index
        sg.store = self.placement.store_for(sg, self._trainable_numel)
        sg.store.place(index, sg)

    # --- the engine's calls -------------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def before_forward(self) -> None:
        self.coordinator.begin_forward()

    def before_backward(self, boundary: bool) -> None:
        # gradients are reduced on every micro-step: no rank ever keeps a full gradient
        self._armed = True
        for store in self.placement.stores:
            store.begin_micro_step(boundary)

    def after_backward(self, boundary: bool) -> None:
        if self._armed:
            # leaf modules' parameters, every one in the same order on every rank so the buckets line up: a rank
            # whose tokens skipped an expert reduces zeros for it
            for p in self._leaf_params:
                grad = p.grad if p.grad is not None else torch.zeros(p.ds_shape, dtype=p.dtype,
                                                                     device=p.ds_tensor.device)
                p.grad = None
                self._queue_gradient(p, grad)
        for p in self.params:  # gradients no hook took (a loss.backward() the engine did not run, or assigned)
            if p.grad is not None and id(p) in self._slot:
                self._grad_ready(p)
        for key in [k for k, items in self._pending.items() if items]:
            self._launch_bucket(key)
        self.wait_reduces(0)
        if boundary:  # what the policy adds once per step (MiCS: the other shard groups' sums)
            self.sharding.after_boundary_reduction([sg.grad for sg in self.sub_groups])
        self._armed = False
        self.coordinator.end_backward()
        for store in self.placement.stores:
            store.end_micro_step()

    def hand_over_to_compiler(self) -> CompilerIntake:
        """DeepCompile gathers and reduces in its graphs: hooks off, all released; returns the buckets' intake, what
        launches the pending buckets (eager ZeRO-3 does it as backward reaches each module, on the CPU) and what
        waits for the reductions in flight (``compile.double_buffer``)."""
        self.coordinator.remove_hooks()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks, self._leaf_params = [], []  # the graph reduces a leaf's parameters like any other
        self.coordinator.release_all(keep_persistent=False)  # the compiler's selective gather decides persistence
        return CompilerIntake(self._queue_gradient, self._reduce_finished_modules, self.wait_reduces,
                              lambda: len(self._inflight))

    # --- gradient reduction -------------------------------------------------------------------------------
    def _reduce_finished_modules(self) -> None:
        """Backward reached another module: reduce what the modules behind it left in the buckets (CPU). Every
        rank runs the same modules in the same order (ZeRO-3's assumption), so the buckets still line up."""
        if self._armed:
            for key in [k for k, items in self._pending.items() if items]:
                self._launch_bucket(key)

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._armed or param.grad is None or not getattr(param, "ds_grad_is_ready", True):
            return  # (DeepSpeed's ``ds_grad_is_ready`` False: more accumulations follow, as in buckets.py)
        grad = param.grad
        param.grad = None
        self._queue_gradient(param, grad)

    def _queue_gradient(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Put ``grad`` (``param``'s full gradient) in its group's bucket, reduce-scattering a full bucket."""
        if self.keeps_whole:
            self._accumulate_whole(param, grad)
            return
        self.coordinator.release_after_grad(param)
        key = (id(param.ds_process_group), is_kept(param))
        self._pending.setdefault(key, []).append((param, grad))
        self._pending_numel[key] = self._pending_numel.get(key, 0) + param.ds_partition_numel * param.ds_world_size
        if self._pending_numel[key] >= self.reduce_bucket_numel:
            self._launch_bucket(key)

    def _accumulate_whole(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """A partition group of one: the full gradient is this rank's shard of it, added to its sub-group's
        accumulator at once, with the arithmetic a bucket does (the comm dtype, the averaging around the
        reduction) but no copy into a bucket."""
        averages = self.averaging.pre_divide != 1.0 or self.averaging.post_scale != 1.0
        flat = grad.reshape(-1).to(torch.float32 if is_kept(param) else self.comm_dtype, copy=averages)  # copy: user's
        self.averaging.before(flat)
        self.averaging.after(flat)
        sg, offset = self._slot[id(param)]
        sg.store.accumulate(sg.index, sg, offset, flat)

    def _launch_bucket(self, key: tuple[int, bool]) -> None:
        items, self._pending[key], self._pending_numel[key] = self._pending[key], [], 0
        group, world = items[0][0].ds_process_group, items[0][0].ds_world_size
        total = sum(p.ds_partition_numel for p, _ in items)
        rows_flat = self._bucket_pool.take(world * total, torch.float32 if key[1] else None)
        rows = rows_flat.view(world, total)
        placed: list[tuple[torch.nn.Parameter, int]] = []
        off = 0
        for p, grad in items:
            part = p.ds_partition_numel
            flat = grad.reshape(-1)
            whole = p.ds_numel // part if part else 0
            if whole:
                rows[:whole, off:off + part].copy_(flat[: whole * part].view(whole, part))
            rest = p.ds_numel - whole * part
            if rest:
                rows[whole, off:off + rest].copy_(flat[whole * part:])
                rows[whole, off + rest:off + part].zero_()  # the last shards' padding
            if whole + (1 if rest else 0) < world:
                rows[whole + (1 if rest else 0):, off:off + part].zero_()
            placed.append((p, off))
            off += part
        self.averaging.before(rows)
        # keep_in_fp32_modules: kept gradients reduce-scatter exactly in fp32 (never through qgZ's INT4)
        reduce_scatter = self.sharding.reduce_scatter_for(group) if world > 1 and not key[1] else None
        if world == 1:
            self._inflight.append((None, rows[0], placed, rows_flat))
        elif reduce_scatter is not None:  # the policy's own (ZeRO++'s quantized one), synchronous
            out = self._bucket_pool.take(total, rows_flat.dtype)
            reduce_scatter(out, rows_flat, tuple(id(p) for p, _ in placed), self.precision.loss_scale)
            self._inflight.append((None, out, placed, rows_flat))
        else:
            out = self._bucket_pool.take(total, rows_flat.dtype)
            work = comm.reduce_scatter_tensor(out, rows_flat, group=group,
                                              async_op=self.ctx.overlap_comm)
            self._inflight.append((work if self.ctx.overlap_comm else None, out, placed, rows_flat))
        # each bucket in flight holds N x its size of gradients: bound them, or a whole model's gradient
        # would pile up until the end of backward
        self.wait_reduces(self.max_buckets_in_flight if self.ctx.overlap_comm else 0)

    def _complete(self, entry: tuple[Any, torch.Tensor, list[tuple[torch.nn.Parameter, int]], torch.Tensor]) -> None:
        work, out, placed, rows = entry
        if work is not None:
            work.wait()
        self.averaging.after(out)
        for p, off in placed:
            sg, sg_off = self._slot[id(p)]
            sg.store.accumulate(sg.index, sg, sg_off, out[off:off + p.ds_partition_numel])
        self._bucket_pool.give(rows)
        if out.data_ptr() != rows.data_ptr():
            self._bucket_pool.give(out)

    def wait_reduces(self, keep: int) -> None:
        """Finish the oldest bucket reductions until at most ``keep`` are in flight (launched, not waited for)."""
        while len(self._inflight) > keep:
            self._complete(self._inflight.pop(0))

    def bucket_pool_bytes(self) -> int:
        """Bytes of the reduce-scatter buffers kept for reuse between buckets (and steps)."""
        return self._bucket_pool.nbytes()

    # --- the optimizer step: each store steps its sub-groups ------------------------------------------------
    def _shards_home(self, masters_only: bool = False) -> None:
        if self.recall_shards is not None:
            self.recall_shards(masters_only=masters_only)

    def _begin_step(self) -> None:
        self._shards_home(masters_only=True)  # the step updates the masters in place (the shards, at fp32)

    def _local_overflow(self) -> bool:
        """Whether this rank's gradients hold an inf or nan."""
        return any(store.overflow() for store in self.placement.stores)

    def _local_sq_norm(self) -> torch.Tensor:
        sq = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)  # this rank's squares, on the device
        if self.keeps_whole and self.shard_ctx.grad_dtype in (None, torch.float32) and all(
                store.kind == "device" for store in self.placement.stores):
            # whole parameters, gradients on the device: stage 0's arithmetic (one fp32 dot per flat gradient,
            # no temporary), not the stores' float64 chunks
            for grad in self.step_gradients():
                sq += torch.dot(grad, grad).double()
            return sq
        for store in self.placement.stores:
            store.add_sq_norm(sq)
        return sq

    def step_gradients(self) -> list[torch.Tensor]:
        return [g for store in self.placement.stores for g in store.gradients()]

    def _apply_update(self, coef: float) -> None:
        """Scale the gradients by ``coef``, step every sub-group and write the model's shards."""
        for store in self.placement.stores:
            store.update(coef)
        self._shards_written()

    def _publish(self) -> None:
        """Write the fp32 masters into the model's shards (after a load); gathered copies are now stale."""
        with torch.no_grad():
            for store in self.placement.stores:
                store.publish()
        self._shards_written()

    def _shards_written(self) -> None:
        if self.param_offload is not None:
            self.param_offload.flush()  # offload_param: the updated shards are in their files
        self.coordinator.invalidate()

    def update_optimizer_step(self, step: int) -> None:
        for store in self.placement.stores:
            store.set_step(step)

    @property
    def last_step_times(self) -> PipelineTimes | None:
        """Where the last offloaded update's time went (None: nothing is offloaded)."""
        return self.placement.times

    # --- offload_states (dsrun/zero/offload_states.py) -----------------------------------------------------
    def state_tensors(self, state: OffloadStateTypeEnum) -> list[StateTensor]:
        if state is not OffloadStateTypeEnum.lp_params:
            return [t for store in self.placement.stores for t in store.state_tensors(state)]
        # the shards; where they alias their sub-group's master (fp32) the master moves, with its views
        aliased = [StateTensor(sg.master, [t for p in sg.params for t in (p.ds_fp32_shard, p.ds_tensor)])
                   for sg in self.sub_groups if sg.master.device.type != "meta" and any(
                       p.ds_tensor.untyped_storage().data_ptr() == sg.master.untyped_storage().data_ptr()
                       for p in sg.params)]
        if self.keeps_whole:  # a whole parameter's .data views its shard: it moves with it
            aliased = [StateTensor(item.tensor, item.views + [p for p in self.params
                                                             if any(p.ds_tensor is v for v in item.views)])
                       for item in aliased]
        inside = {id(view) for item in aliased for view in item.views}
        return aliased + [StateTensor(p.ds_tensor, [p] if self.keeps_whole else [])
                          for p in self.params if id(p.ds_tensor) not in inside]

    def gradient_buckets(self) -> list[torch.Tensor]:
        return list(self._bucket_pool.buffers)

    def release_gradient_buckets(self) -> list[torch.Tensor]:
        released, self._bucket_pool.buffers = self._bucket_pool.buffers, []
        return released

    def keep_gradient_buckets(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self._bucket_pool.give(buffer)

    def before_offload(self) -> None:
        self._shards_home()
        self.coordinator.invalidate()  # gathered copies (persistent ones too) are gathered again when needed
        self.coordinator.buffer_pool.clear()

    def offload_refusal(self) -> str | None:
        if self.ctx.sharding is not None:
            return "not with ZeRO++/MiCS/hpZ: their secondary and quantized partitions are not states it moves"
        return None

    def close(self) -> None:
        self.close_state_copies()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        self.parameter_offload.close()
        self._bucket_pool.buffers = []
        for store in self.placement.stores:
            store.close()

    def empty_partition_cache(self) -> None:
        """Release every gathered parameter, persistent ones included (``engine.empty_partition_cache()``)."""
        self.parameter_offload.empty_partition_cache()

    def zero_grad(self) -> None:
        for store in self.placement.stores:
            store.zero_grad()
        for p in self.params:
            p.grad = None

    # --- accounting ---------------------------------------------------------------------------------------
    def memory_breakdown(self) -> MemoryBreakdown:
        """Shards of every parameter plus the full copies of persistent ones; the fp32 gradient and master
        partitions resident in memory (host-offloaded ones included, swapped ones not: their swap buffers are
        ``buffers``); the optimizer state. ``padding`` counts the zero tail of this rank's shards (in memory, in
        all of them; offloaded, in the shards only)."""
        base = self.parameter_offload.memory_breakdown()  # the shards, persistent copies, their padding, gathers
        stores = self.placement.stores
        grads = sum(store.grad_bytes() for store in stores)
        masters = sum(store.master_bytes() for store in stores)
        states = optimizer_state_bytes(self._optimizer)
        trainable_elems = sum(sg.numel for sg in self.sub_groups) if self.placement.offloaded is None else 0
        per_elem = (grads + masters + states) / trainable_elems if trainable_elems else 0.0
        padding = base.padding + per_elem * sum(shard_padding(p, comm.get_rank(p.ds_process_group))
                                                for p in self.params if id(p) in self._slot)
        # NVMe parameter offload: the shards are in files (ds_tensor is empty); the read/write pool and the
        # shards cached in host memory (max_in_cpu) count as buffers
        pool = base.buffers + self.bucket_pool_bytes() + sum(s.buffer_bytes() for s in stores)
        return MemoryBreakdown(parameters=base.parameters, gradients=grads, master_weights=masters,
                               optimizer_states=states, padding=int(padding), buffers=pool)

    # --- checkpoints and exports --------------------------------------------------------------------------
    def checkpoint_param_shapes(self) -> list["OrderedDict[str, torch.Size]"]:
        names = self._names()  # shards of whole parameters, per sub-group
        return [OrderedDict((names[id(p)], torch.Size(p.ds_shape)) for p in sg.params) for sg in self.sub_groups]

    def master_partitions(self) -> list[tuple[int, int, Any]]:
        # a sub-group holds one param group's shards, all partitioned over the same group
        return [(sg.params[0].ds_world_size, comm.get_rank(sg.params[0].ds_process_group),
                 sg.params[0].ds_process_group) for sg in self.sub_groups]

    def full_param_value(self, param: torch.nn.Parameter) -> torch.Tensor:
        return full_tensor(param).cpu()

    def frozen_param_fragments(self) -> tuple[dict[str, torch.Size], dict[str, torch.Tensor]]:
        from dsrun.checkpoint.state import frozen_params

        def shard_of(p: torch.nn.Parameter) -> torch.Tensor:  # NVMe shards: from files; kept INT8: decoded
            if quantized_shards.message_of(p) is not None:
                return quantized_shards.dequantized_shard(p)
            return param_swapper.shard_value(p)

        return frozen_params(self.ctx.module, shard_of=shard_of)

    def frozen_param_messages(self) -> dict[str, torch.Tensor]:
        """This rank's INT8 messages of the frozen shards kept quantized, by name (what it stores, exactly)."""
        return {name: quantized_shards.message_of(p).cpu().clone() for name, p in self.ctx.module.named_parameters()
                if quantized_shards.message_of(p) is not None}

    @property
    def checkpoint_layout(self) -> CheckpointLayout:
        layout = layout_for_stage(3)
        if self.sharding.mics:  # the policy's masters are cut over shard groups, which resharding does not know
            return dataclasses.replace(layout, reshard_refusal=f"a MiCS run (mics_shard_size {self.sharding.shard_size})")
        return layout

    def state_dict(self) -> dict[str, Any]:
        self._shards_home()
        names = {id(p): n for n, p in self.ctx.module.named_parameters()}
        sd = {
            "zero_stage": 3,
            **self.sharding.checkpoint_entries(),  # partition_count, mics_shard_size (DeepSpeed's layout keys)
            "overflow": False,
            "optimizer_state_dict": self._optimizer_state_dict(),
            "fp32_flat_groups": [sg.store.master_for_checkpoint(i, sg) for i, sg in enumerate(self.sub_groups)],
            "param_shapes": [OrderedDict((names[id(p)], p.ds_shape) for p in sg.params) for sg in self.sub_groups],
        }
        sd.update(self.precision.state_dict())
        return sd

    def _optimizer_state_dict(self) -> dict[str, Any]:
        osd = self._optimizer.state_dict()
        swapped = {i: sg.store.state_entry(i) for i, sg in enumerate(self.sub_groups)}
        swapped = {i: entry for i, entry in swapped.items() if entry is not None}
        if swapped:  # states the store keeps itself (swap files), mapped from their files
            osd["state"] = dict(sorted({**osd["state"], **swapped}.items()))
        return osd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("partition_count") != self.sharding.shard_size:
            raise RuntimeError("ZeRO-3 state was saved partitioned over a different number of ranks "
                               f"({sd.get('partition_count')}) than this run's ({self.sharding.shard_size})")
        self._shards_home()
        osd = sd["optimizer_state_dict"]
        state = {int(k): v for k, v in osd["state"].items()}
        with torch.no_grad():
            for i, (sg, saved) in enumerate(zip(self.sub_groups, sd["fp32_flat_groups"])):
                if sg.store.load(i, sg, saved, state.get(i)):  # the store took the optimizer state too
                    state.pop(i, None)
        self._optimizer.load_state_dict({**osd, "state": state})
        self.precision.load_state_dict(sd)
        self._publish()

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """The full model state dict (collective); None when ``stage3_gather_16bit_weights_on_model_save``
        is off, as DeepSpeed then saves nothing."""
        if not self.gather_16bit_on_save:
            return None
        return self.full_16bit_state_dict(exclude_frozen_parameters)

    def full_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter gathered, whatever the save flag says (collective; see the base class)."""
        self._shards_home()
        return full_state_dict(self.ctx.module, exclude_frozen_parameters=exclude_frozen_parameters)


class DeepSpeedZeroOptimizer_Stage3(metaclass=OptimizerWrapperKind):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's stage-3 optimizer name: an optimizer stepped by :class:`Stage3Strategy`
    (:mod:`dsrun.optim.optimizer_wrappers`)."""
