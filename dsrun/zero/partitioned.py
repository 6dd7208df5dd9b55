"""ZeRO stages 1 and 2: fp32 master weights and optimizer state partitioned across ranks.

Each flat group is padded to a multiple of ``2 * world_size`` and split into equal contiguous partitions;
rank r keeps the fp32 master copy and the optimizer state of partition r only, updates it, and the
updated partitions are all-gathered back into every rank's model (``allgather_bucket_size`` elements per
collective).

* **Stage 1** keeps full gradients: they accumulate locally over micro-steps in a flat buffer, and on the
  boundary micro-step each bucket is reduce-scattered (as soon as backward completes it with
  ``overlap_comm``, else after backward) so each rank receives the sum for its own partition.
* **Stage 2** never holds the full gradient: on every micro-step each parameter's gradient is copied into
  its bucket and released; a complete bucket is reduce-scattered at once (asynchronously with
  ``overlap_comm``) and each rank adds its share into an fp32 partition-sized accumulator.

A bucket may cross partition boundaries, so the reduce-scatter gives each rank the piece of the bucket it
owns, which may be empty (a variable-size reduce-scatter). ``reduce_scatter: false`` all-reduces the
bucket instead and keeps the owned piece (DeepSpeed's option; twice the traffic).
``use_multi_rank_bucket_allreduce: false`` reduces each rank's piece to that rank alone (one ``reduce`` per
owning rank, DeepSpeed's older single-rank path) instead of the one reduce-scatter; the same partitions.

``engine.offload_states()`` moves what each state names here (:mod:`.offload_states`): ``hp_params`` the fp32
masters and ``optim_states`` their optimizer state (the store's: on the host already with ``offload_optimizer``),
``lp_params`` the model's flat buffers with the parameters (and the store's partitions) that are views of them,
``lp_grads`` the gradient buffers (stage 1: the whole flat gradients with each ``.grad`` view, and the reduced
partitions; stage 2: the fp32 partition accumulators); ``contiguous_grad_buffer`` releases stage 2's pooled
bucket buffers.

``round_robin_gradients`` lays each flat group out round-robin over the ranks (:func:`round_robin_order`), as
DeepSpeed does at these stages: the same values, another order of parameters in the buffers and partitions.
"""
from __future__ import annotations

import torch

from dsrun import comm
from dsrun.offload.flat_store import DeviceFlatStore, flat_store
from dsrun.offload.state_moves import OffloadStateTypeEnum, StateTensor

from dsrun.zero.base import FlatStrategy
from dsrun.zero.memory import MemoryBreakdown, optimizer_state_bytes, tensor_bytes
from dsrun.zero.buckets import Bucket
from dsrun.zero.grad_accum import SeparateAccumulator
from dsrun.zero.layout import FlatGradients, FlatGroup
from dsrun.zero.offload_states import StatesOffload, optimizer_state_tensors


def round_robin_order(params: list[torch.nn.Parameter], ranks: int) -> list[torch.nn.Parameter]:
    """``round_robin_gradients`` (DeepSpeed's ``_round_robin_reorder``): the parameters laid out as every
    ``ranks``-th one from the first, then from the second ...; consecutive gradients of the model (backward
    produces them in about the reverse of this order) then fall in different ranks' partitions, so the ranks
    share the work of receiving them (with CPU offload: copying them to the host) instead of taking turns."""
    return [p for start in range(min(ranks, len(params))) for p in params[start::ranks]]


class PartitionedStrategy(StatesOffload, FlatStrategy):
    alignment_per_rank = 2  # DeepSpeed pads each flat group to a multiple of 2 * world_size
    partitioned = True

    def __init__(self, ctx) -> None:
        if ctx.zero_config.round_robin_gradients:  # before the flat groups are laid out from the param groups
            for param_group in ctx.optimizer.param_groups:
                trainable = [p for p in param_group["params"] if p.requires_grad]
                param_group["params"] = round_robin_order(param_group["params"], ctx.process_group_of(trainable)[1])
        super().__init__(ctx)

    @property
    def scatters_gradients(self) -> bool:  # type: ignore[override]
        return self.ctx.reduce_scatter

    def _owned_slices(self, group: FlatGroup, bucket: Bucket) -> list[tuple[int, int]]:
        """For each rank, the part of ``bucket`` inside its partition, as offsets into the bucket."""
        pieces = []
        for r in range(group.world_size):
            lo, hi = group.partition_range(r)
            lo, hi = max(lo, bucket.start), min(hi, bucket.end)
            pieces.append((lo - bucket.start, hi - bucket.start) if hi > lo else (0, 0))
        return pieces

    def _owned_part(self, partition_buffers: list[torch.Tensor], bucket: Bucket) -> torch.Tensor:
        """The slice of this rank's partition-sized buffer (of ``bucket``'s group) that ``bucket`` covers."""
        group = self.groups[bucket.group_index]
        lo, hi = self._owned_slices(group, bucket)[group.rank]
        offset = bucket.start + lo - group.partition_range(group.rank)[0]
        return partition_buffers[bucket.group_index][offset:offset + (hi - lo)]

    def _make_store(self, ctx) -> DeviceFlatStore:
        return flat_store(ctx)  # offload_optimizer: the device or the host

    def _begin_step(self) -> None:
        unreceived = self.queue.take_unreceived()
        if not self.ctx.zero_config.ignore_unused_parameters:
            self._refuse_unused_parameters(unreceived)
        super()._begin_step()

    def _refuse_unused_parameters(self, unreceived: list[tuple[int, int]]) -> None:
        """``ignore_unused_parameters: false``: a trainable parameter no backward of this step reached is an
        error on every rank (agreed over the group, so no rank waits in a collective the others left), with
        DeepSpeed's message and the parameters' names."""
        names = self._names()
        unused = [names.get(id(self.groups[gi].params[pi]), f"group {gi} parameter {pi}") for gi, pi in unreceived]
        flag = torch.tensor([float(len(unused))], device=self.ctx.device)
        if self.world_size > 1:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.ctx.group)
        if flag.item() > 0:
            where = f"on this rank: {unused}" if unused else "on another rank"
            raise AssertionError(
                "This assert indicates that your module has parameters that were not used in producing loss. "
                "You can avoid this assert by (1) enable ignore_unused_parameters option in zero_optimization "
                "config; (2) making sure all trainable parameters and `forward` function outputs participate in "
                f"calculating loss. (unused {where})")

    def _build_masters(self) -> list[torch.nn.Parameter]:
        return self.store.masters([g.flat_param[slice(*g.partition_range(g.rank))] for g in self.groups])

    def _reduce_bucket(self, bucket: Bucket, source: torch.Tensor, out: torch.Tensor, async_op: bool) -> None:
        """Reduce-scatter ``source`` (the bucket's gradients) so ``out`` gets this rank's owned piece."""
        group = self.groups[bucket.group_index]
        self._divide_before_reduce(source)
        if group.world_size == 1:
            out.copy_(source)
            bucket.handles.append((None, out, out))
            return
        pieces = self._owned_slices(group, bucket)
        comm_dtype = self._comm_dtype_of(group)
        if comm_dtype != source.dtype:
            source = source.to(comm_dtype)
        lo, hi = pieces[group.rank]
        if not self.ctx.reduce_scatter:
            target = source
            bucket.handles.append((comm.all_reduce(target, group=group.process_group, async_op=async_op),
                                   target[lo:hi], out))
            return
        if not self.ctx.zero_config.use_multi_rank_bucket_allreduce:  # DeepSpeed's single-rank path
            for r, (a, b) in enumerate(pieces):  # each rank's piece reduced to that rank alone
                if b > a:
                    work = comm.reduce(source[a:b], dst=comm.get_global_rank(group.process_group, r),
                                       group=group.process_group, async_op=async_op)
                    bucket.handles.append((work, source[a:b], out if r == group.rank else None))
            return
        target = out if out.dtype == comm_dtype else torch.empty(hi - lo, dtype=comm_dtype, device=out.device)
        inputs = [source[a:b] for a, b in pieces]
        bucket.handles.append((comm.reduce_scatter(target, inputs, group=group.process_group, async_op=async_op),
                               target, out))

    def _finish_handles(self, bucket: Bucket) -> None:
        """Wait for the bucket's collectives and move each result into its destination."""
        for handle, result, out in bucket.handles:
            if handle is not None:
                handle.wait()
            if out is None:  # another rank's piece, reduced to it (use_multi_rank_bucket_allreduce: false)
                continue
            if result is not out:
                out.copy_(result)
            self.averaging.after(out)
        bucket.handles = []

    def _publish(self) -> None:
        with torch.no_grad():
            for gi, (group, master) in enumerate(zip(self.groups, self.masters)):
                chunk = max(1, int(self.ctx.allgather_bucket_size) // group.world_size)
                part = self.store.published(gi, master, group.world_size)
                if group.world_size == 1:
                    if part.data_ptr() != group.flat_param.data_ptr():
                        group.flat_param.copy_(part)
                    continue
                size = group.partition_numel
                if size <= chunk:
                    comm.all_gather_into_tensor(group.flat_param, part, group=group.process_group)
                    continue
                for start in range(0, size, chunk):
                    end = min(size, start + chunk)
                    outputs = [group.flat_param[r * size + start:r * size + end] for r in range(group.world_size)]
                    comm.all_gather(outputs, part[start:end].contiguous(), group=group.process_group)

    def _partition_state_bytes(self) -> tuple[int, int]:
        return optimizer_state_bytes(self.optimizer), self._master_bytes()

    # --- offload_states (dsrun/zero/offload_states.py) -------------------------------------------------------
    def state_tensors(self, state: OffloadStateTypeEnum) -> list[StateTensor]:
        if state is OffloadStateTypeEnum.hp_params:
            return [StateTensor(m) for m in self.masters]
        if state is OffloadStateTypeEnum.optim_states:
            return optimizer_state_tensors(self.optimizer, self.masters)
        if state is OffloadStateTypeEnum.lp_params:  # the parameters (and the store's partitions) are views
            views = self.store.model_views()
            return [StateTensor(g.flat_param, list(g.params) + views) for g in self.groups]
        if state is OffloadStateTypeEnum.lp_grads:
            return self._gradient_tensors()
        return []

    def _gradient_tensors(self) -> list[StateTensor]:
        """The gradient buffers ``lp_grads`` names at this stage."""
        return []

    def close(self) -> None:
        super().close()
        self.close_state_copies()


class Stage1Strategy(PartitionedStrategy):
    """Optimizer state partitioned; gradients kept whole and reduce-scattered at the boundary."""

    stage = 1

    @property
    def supports_local_gradients(self) -> bool:  # type: ignore[override]
        return self.store.on_device  # offloaded: the step reads the reduced partition only

    def _build_buffers(self) -> None:
        self.grads = FlatGradients(self.groups)
        self.flat_grads = self.grads.flats
        # data_types.grad_accum_dtype naming another dtype: the micro-steps add up in a whole accumulator of that
        # dtype, which the boundary reduces (in its reduce dtype) into a partition of that dtype (grad_accum.py)
        accumulation = self.ctx.accumulation
        self.accumulator = None if accumulation is None else SeparateAccumulator(
            self.groups, accumulation, self.grads.flats, self.grads.views)
        if accumulation is not None:
            self.comm_dtype = accumulation.reduce_dtype or self.model_dtype
        self.partition_grads = [torch.zeros(g.partition_numel, dtype=g.flat_param.dtype if accumulation is None
                                            else accumulation.dtype, device=self.ctx.device) for g in self.groups]
        # a second boundary backward before the step (a GAN's real and fake losses): the partition already
        # holds the first reduction, so the next one is added to it and the flat buffer starts from zero
        self._reduced_since_step = False
        self._adding = False
        self.master_grads = self.store.gradients([g.partition_numel for g in self.groups], self.partition_grads)

    def _on_accumulated(self, gi: int, pi: int) -> None:
        self.grads.adopt(gi, pi)
        if self.accumulator is not None:  # immediate: into the accumulator as the hook fires
            self.accumulator.take_parameter(gi, pi)

    def _gradient_tensors(self) -> list[StateTensor]:
        # each parameter's .grad is a view of its group's flat gradient; the fp32 gradients are the reduced
        # partitions themselves in fp32 (repeats move once)
        flats = [StateTensor(flat, views) for flat, views in zip(self.grads.flats, self.grads.views)]
        sums = [] if self.accumulator is None else [StateTensor(t) for t in self.accumulator.sums]
        return flats + sums + [StateTensor(g) for g in self.partition_grads + self.master_grads]

    def local_gradients(self) -> list[torch.Tensor]:
        return self.flat_grads if self.accumulator is None else self.accumulator.sums

    def _zero_local(self) -> None:
        self.grads.zero()
        if self.accumulator is not None:
            self.accumulator.zero()

    def before_backward(self, boundary: bool) -> None:
        if boundary and self._reduced_since_step:
            self._zero_local()
            self._adding = True
        super().before_backward(boundary)

    def after_backward(self, boundary: bool) -> None:
        reducing = self.queue.active
        super().after_backward(boundary)
        self._reduced_since_step = self._reduced_since_step or reducing
        if not reducing and self.accumulator is not None:  # a micro-step that reduced nothing: fold it in
            self.accumulator.take_all()

    def _reduce(self, bucket: Bucket, async_op: bool) -> None:
        if bucket.pending > 0:  # parameters this backward did not reach: their .grad may have been replaced
            for pi in bucket.param_indices:
                self.grads.adopt(bucket.group_index, pi)
        if self.accumulator is not None:  # the boundary's own gradients join the sum, which is reduced
            source = self.accumulator.take_range(bucket.group_index, bucket.start, bucket.end)
        else:
            source = self.flat_grads[bucket.group_index][bucket.start:bucket.end]
        owned = self._owned_part(self.partition_grads, bucket)
        if self._adding:
            bucket.received = torch.empty_like(owned)
        self._reduce_bucket(bucket, source, owned if bucket.received is None else bucket.received, async_op)

    def _complete(self, bucket: Bucket) -> None:
        self._finish_handles(bucket)
        if bucket.received is not None:
            self._owned_part(self.partition_grads, bucket).add_(bucket.received)
            bucket.received = None

    def _master_grads(self) -> list[torch.Tensor]:
        if not self.reduction.reduced:  # nothing was reduce-scattered: this rank's own part of its gradient
            for gi, (master_grad, flat) in enumerate(zip(self.master_grads, self.local_gradients())):
                lo, hi = self.groups[gi].partition_range(self.rank)
                master_grad.copy_(flat[lo:hi])
            return self.master_grads
        return self.store.step_gradients(self.partition_grads, self.master_grads)

    def zero_grad(self) -> None:
        self._zero_local()
        self._reduced_since_step = self._adding = False

    def memory_breakdown(self) -> MemoryBreakdown:
        grads = sum(tensor_bytes(g) for g in self.flat_grads) + sum(tensor_bytes(g) for g in self.partition_grads)
        grads += 0 if self.accumulator is None else self.accumulator.nbytes()
        if self.master_grads is not self.partition_grads:
            grads += sum(tensor_bytes(g) for g in self.master_grads)
        states, masters = self._partition_state_bytes()
        return MemoryBreakdown(parameters=self._param_bytes(), gradients=grads, master_weights=masters,
                               optimizer_states=states, padding=self._padding_bytes())


class Stage2Strategy(PartitionedStrategy):
    """Optimizer state and gradients partitioned; buckets reduce-scattered during every backward."""

    stage = 2
    reduce_every_micro_step = True

    # A released bucket buffer is kept for reuse (at most this many per size): allocating and first-touching
    # a fresh buffer of reduce_bucket_size elements on every bucket of every step costs more than the copy.
    POOLED_BUFFERS_PER_SIZE = 2

    def _build_buffers(self) -> None:
        # fp32 accumulators for this rank's partition: the only gradient storage that outlives a bucket (in
        # data_types.grad_accum_dtype when it names another dtype; the step then reads a copy in the masters')
        accumulation = self.ctx.accumulation
        self.master_grads = self.store.gradients([g.partition_numel for g in self.groups],
                                                 dtype=None if accumulation is None else accumulation.dtype)
        self._step_copies: list[torch.Tensor] = []
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._ready: set[tuple[int, int]] = set()
        for group in self.groups:
            for p in group.params:
                p.grad = None

    def _gradient_tensors(self) -> list[StateTensor]:
        return [StateTensor(g) for g in self.master_grads]

    def gradient_buckets(self) -> list[torch.Tensor]:
        return [b for free in self._pool.values() for b in free]

    def release_gradient_buckets(self) -> list[torch.Tensor]:
        released, self._pool = self.gradient_buckets(), {}
        return released

    def keep_gradient_buckets(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self._give_back(buffer)

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._pool.get((numel, dtype))
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=self.ctx.device)

    def _give_back(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            free = self._pool.setdefault((buffer.numel(), buffer.dtype), [])
            if len(free) < self.POOLED_BUFFERS_PER_SIZE:
                free.append(buffer)

    def _staging(self, bucket: Bucket) -> torch.Tensor:
        if bucket.staging is None:
            # contiguous_gradients: each bucket's gradients are packed into one buffer as they arrive
            group = self.groups[bucket.group_index]
            bucket.staging = self._take(bucket.numel, group.flat_param.dtype)
            if bucket.end > group.numel:  # the alignment padding at the end of the group
                bucket.staging[max(0, group.numel - bucket.start):].zero_()
            for lo, hi in group.gaps:  # parameter_alignment's zeros between parameters
                lo, hi = max(lo, bucket.start), min(hi, bucket.end)
                if hi > lo:
                    bucket.staging[lo - bucket.start:hi - bucket.start].zero_()
        return bucket.staging

    def before_backward(self, boundary: bool) -> None:
        self._ready.clear()
        super().before_backward(boundary)

    def _on_param_ready(self, gi: int, pi: int, buckets: list[Bucket]) -> None:
        group = self.groups[gi]
        param = group.params[pi]
        grad = param.grad.reshape(-1)
        off, n = group.offsets[pi], group.numels[pi]
        for bucket in buckets:
            lo, hi = max(off, bucket.start), min(off + n, bucket.end)
            self._staging(bucket)[lo - bucket.start:hi - bucket.start].copy_(grad[lo - off:hi - off])
        self._ready.add((gi, pi))
        param.grad = None  # the full gradient of this parameter is not kept

    @property
    def reduce_during_backward(self) -> bool:
        return True  # the gradients are released as buckets fill, so they must be reduced then

    def _reduce(self, bucket: Bucket, async_op: bool) -> None:
        staging = self._staging(bucket)
        if bucket.pending > 0:  # parameters that got no gradient this pass: what .grad holds (None: zeros)
            group = self.groups[bucket.group_index]
            for pi in bucket.param_indices:
                if (bucket.group_index, pi) not in self._ready:
                    param, off, n = group.params[pi], group.offsets[pi], group.numels[pi]
                    lo, hi = max(off, bucket.start), min(off + n, bucket.end)
                    piece = staging[lo - bucket.start:hi - bucket.start]
                    if param.grad is None:
                        piece.zero_()
                    else:  # assigned by the user: reduced like a computed one, then released
                        piece.copy_(param.grad.reshape(-1)[lo - off:hi - off])
                        if off >= bucket.start:  # buckets run from the end: this is its last piece
                            param.grad = None
        bucket.received = self._take(self._owned_part(self.master_grads, bucket).numel(),
                                     self.groups[bucket.group_index].flat_param.dtype)
        self._reduce_bucket(bucket, staging, bucket.received, async_op=async_op)

    def _complete(self, bucket: Bucket) -> None:
        if bucket.received is None:  # already completed inside backward
            return
        self._finish_handles(bucket)
        owned = self._owned_part(self.master_grads, bucket)
        owned.add_(bucket.received.to(owned.device))  # accumulate over micro-steps (on the host with offload)
        self._give_back(bucket.received)
        self._give_back(bucket.staging)  # release the bucket's copy of the gradients
        bucket.received = None
        bucket.staging = None

    def _master_grads(self) -> list[torch.Tensor]:
        master_dtype = self.masters[0].dtype if self.masters else self.model_dtype
        if all(g.dtype == master_dtype for g in self.master_grads):
            return self.master_grads
        self._step_copies = [g.to(master_dtype) for g in self.master_grads]  # until zero_grad
        return self._step_copies

    def zero_grad(self) -> None:
        if self._step_copies:  # the step's copies in the masters' dtype (grad_accum_dtype) are not kept
            self._step_copies = self._step_grads = []
        for g in self.master_grads:
            g.zero_()
        for group in self.groups:
            for p in group.params:
                p.grad = None

    def memory_breakdown(self) -> MemoryBreakdown:
        grads = sum(tensor_bytes(g) for g in self.master_grads)
        states, masters = self._partition_state_bytes()
        pooled = sum(tensor_bytes(b) for free in self._pool.values() for b in free)
        return MemoryBreakdown(parameters=self._param_bytes(), gradients=grads, master_weights=masters,
                               optimizer_states=states, padding=self._padding_bytes(), buffers=pooled)
