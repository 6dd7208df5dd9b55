"""DeepCompile's runtime at ZeRO-3: what the compiled graph's gather, release and reduce ops act on.

DeepSpeed keeps this state in a C++ object (``DeepCompileBuilder``'s handle, CUDA). dsrun's is this Python class
over its own partitioned parameters (:mod:`dsrun.zero.partition_params`: ``ds_tensor`` shards, ``ds_shape``) and
its stage-3 strategy's gradient buckets, reached by the ops of :mod:`.ops`:

* ``allgather_param`` all-gathers one parameter's shards into a fresh buffer owned by the graph (the
  parameter's own ``.data`` stays the empty placeholder: the graph never changes it); a prefetch started earlier
  (``prefetch_param``, asynchronous) is waited for instead; a parameter made persistent (selective gather) is
  served from its kept copy, refreshed after each optimizer step.
* ``release_param`` marks the gathered buffer's last reader: its memory goes when the graph drops its last
  reference, which the FX interpreter and inductor's code do right there; the handle counts what is live.
* ``reload_parameter``/``offload_parameter`` (``compile.offload_parameters``) move a parameter's shard between the
  training device and its host buffer (:attr:`DeepCompileHandle.param_moves`, a :class:`.shard_moves.ShardMoves`);
  a gather that finds its shard on the host brings it back first.
* ``reduce_grad`` hands a full gradient to the strategy's reduce-scatter buckets (a copy: the compiled graph
  may reuse its buffer), as the eager ZeRO-3 gradient hook does, cast to the parameter's expected gradient dtype
  (:func:`dsrun.compile.init._resolve_expected_grad_dtype`: torch's ``grad_dtype`` contract).

``compile.sync_before_reduce``/``sync_after_reduce``/``sync_before_allgather``/``sync_after_allgather`` (DeepSpeed's
debugging switches, :meth:`DeepCompileHandle.set_sync_points`) synchronize the accelerator around each
``reduce_grad`` and each gathering op, as DeepSpeed's handle calls ``device_synchronize`` there: on CUDA the
device's queued work finishes first; on a CPU there is no queue (the call returns at once), so what shows is the
count, ``stats.syncs``.

``compile.double_buffer`` (DeepSpeed's ``DoubleBufferedReduceBucket``: two reduce buffers per dtype, swapped at each
flush, the next gradient's copy into a buffer waiting for that buffer's last reduce-scatter) sets how many of the
strategy's bucket reductions may be in flight when a gradient arrives: on, the bucket just launched keeps running
while the next one fills (two in flight right after a launch, the one before waited for); off, a gradient waits
for every reduction in flight first (one at most). ``stats.peak_reduces_in_flight`` counts it. Only the moment of
each wait changes: the buckets complete and accumulate in launch order either way (bit-identical gradients).

While a profiler runs a graph on real inputs (:meth:`DeepCompileHandle.enable_profiling`, DeepSpeed's switch of
the same name; :mod:`.profilers.graph_profile`'s interpreters) each op runs several times: ``reduce_grad`` and
``end_backward`` then hand nothing to the strategy (as DeepSpeed's handle skips its reduce while profiling), and the
counts are put back as they were when profiling ends. ``clear_all_gathered_params`` drops what a run that raised
left gathered (prefetches in flight; the persistent copies stay, as DeepSpeed's keeps them).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from dsrun import comm

if TYPE_CHECKING:
    from dsrun.compile.shard_moves import ShardMoves


@dataclass
class GatherStats:
    """Counts since the last :meth:`DeepCompileHandle.reset_stats`: what a test or a benchmark reads."""

    gathers: int = 0  # collectives run (synchronous or prefetched)
    prefetched: int = 0  # of those, started ahead by ``prefetch_param``
    persistent_hits: int = 0  # served from a kept copy, no collective
    releases: int = 0
    reduced: int = 0  # gradients handed to the strategy
    syncs: int = 0  # accelerator synchronizations at the compile.sync_* points
    peak_reduces_in_flight: int = 0  # the most bucket reductions launched and not yet waited for at once
    backward_ends: int = 0  # end_backward ops run
    bucket_releases: int = 0  # of those, the ones that launched the pending buckets
    live_numel: int = 0  # gathered elements whose release has not been seen
    peak_live_numel: int = 0
    order: list[tuple[str, int]] = field(default_factory=list)  # (op, ds_id), in the order they ran


class DeepCompileHandle:
    """The parameters a compiled graph gathers, by ``ds_id``; the strategy its gradients go to."""

    def __init__(self) -> None:
        self.params: dict[int, torch.nn.Parameter] = {}
        self.expected_grad_dtype: dict[int, torch.dtype | None] = {}
        self.persistent: set[int] = set()
        self._kept: dict[int, torch.Tensor] = {}  # persistent parameters' gathered copies
        self._inflight: dict[int, tuple[torch.Tensor, Any]] = {}  # prefetches: (buffer, work)
        self.reduce: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None
        self.release_buckets: Callable[[], None] | None = None
        self.wait_reduces: Callable[[int], None] | None = None
        self.reduces_in_flight: Callable[[], int] | None = None
        self.reduce_buffers = 2  # compile.double_buffer: 2 on, 1 off
        self.graphs: dict[int, list[int]] = {}  # graph id -> ds_ids it gathers (DeepSpeed's register_graph_z3)
        self.stats = GatherStats()
        self.gather_seconds: dict[int, float] = {}  # the last synchronous all-gather of each parameter (selective gather)
        self.record_order = False
        self.sync_points: frozenset[str] = frozenset()
        self.param_moves: ShardMoves | None = None  # compile.offload_parameters' shards, when that pass runs
        self._stats_before_profiling: GatherStats | None = None  # set while profiling (enable_profiling)

    # --- registration (DeepSpeed's ``dc.init``, ``register_z3_param``, ``register_graph_z3``) --------------
    def init(self, reduce: Callable[[torch.nn.Parameter, torch.Tensor], None] | None,
             release_buckets: Callable[[], None] | None = None, wait_reduces: Callable[[int], None] | None = None,
             reduces_in_flight: Callable[[], int] | None = None, double_buffer: bool = True) -> None:
        """``reduce`` takes each gradient; ``release_buckets`` launches the buckets still pending;
        ``wait_reduces(n)`` finishes the oldest reductions until ``n`` are in flight, ``reduces_in_flight()`` counts
        them; ``double_buffer`` (``compile.double_buffer``): whether a launched bucket's reduction may run on while
        the next bucket fills."""
        self.reduce = reduce
        self.release_buckets = release_buckets
        self.wait_reduces = wait_reduces
        self.reduces_in_flight = reduces_in_flight
        self.reduce_buffers = 2 if double_buffer else 1

    def register_z3_param(self, param: torch.nn.Parameter, expected_grad_dtype: torch.dtype | None = None) -> None:
        """``expected_grad_dtype``: the dtype a gradient is cast to before its reduction (None: as it comes)."""
        self.params[param.ds_id] = param
        self.expected_grad_dtype[param.ds_id] = expected_grad_dtype

    def register_graph_z3(self, graph_id: int, ds_ids: list[int]) -> None:
        self.graphs[graph_id] = list(ds_ids)

    SYNC_POINTS = ("before_reduce", "after_reduce", "before_allgather", "after_allgather")

    def set_sync_points(self, **points: bool) -> None:
        """Where to synchronize the accelerator: ``before_reduce=True`` etc. (the ``compile.sync_*`` keys)."""
        unknown = set(points) - set(self.SYNC_POINTS)
        if unknown:
            raise ValueError(f"sync points are {self.SYNC_POINTS}, not {sorted(unknown)}")
        self.sync_points = frozenset(p for p, on in points.items() if on)

    def _sync(self, point: str) -> None:
        if point in self.sync_points:
            from dsrun.accelerator import get_accelerator

            get_accelerator().synchronize()
            self.stats.syncs += 1

    def set_persistent(self, ds_id: int) -> None:
        """Keep ``ds_id`` gathered between uses (selective gather): one collective per optimizer step."""
        self.persistent.add(ds_id)

    def reset(self) -> None:
        """The graphs are compiled again (a new schedule step): their records and the kept copies go (DeepSpeed's
        ``reset``: its graph executors)."""
        self.wait_all()
        self.graphs.clear()
        self._kept.clear()

    def cleanup(self) -> None:
        """Forget every parameter, kept copy and the gradient intake (a new engine, or ``engine.destroy()``)."""
        self.reset()
        self.params.clear()
        self.expected_grad_dtype.clear()
        self.persistent.clear()
        self.reduce = None
        self.release_buckets = None
        self.wait_reduces = self.reduces_in_flight = None
        self.reduce_buffers = 2
        self.sync_points = frozenset()
        self._stats_before_profiling = None
        if self.param_moves is not None:
            self.param_moves.close()  # every shard back where the strategy keeps it
            self.param_moves = None
        self.reset_stats()

    def enable_profiling(self, enabled: bool) -> None:
        """A profiler starts (``True``) or stops running graphs: meanwhile nothing is reduced and the counts taken
        are dropped at the end (a profiled op runs once per warm-up and timed iteration, not once per step)."""
        if enabled and self._stats_before_profiling is None:
            # the step's counts are put aside untouched; the profiled runs count on a copy, dropped at the end
            self._stats_before_profiling = self.stats
            self.stats = dataclasses.replace(self.stats, order=list(self.stats.order))
        elif not enabled and self._stats_before_profiling is not None:
            self.stats, self._stats_before_profiling = self._stats_before_profiling, None

    @property
    def profiling(self) -> bool:
        return self._stats_before_profiling is not None

    def clear_all_gathered_params(self) -> None:
        """What a profiled run that raised left gathered goes: its prefetches are finished and dropped, nothing is
        counted live; the persistent parameters' kept copies stay."""
        self.wait_all()
        self.stats.live_numel = 0

    def reset_stats(self) -> None:
        self.stats = GatherStats()

    def invalidate(self) -> None:
        """The shards changed (an optimizer step): kept copies are stale."""
        self._kept.clear()

    # --- what the ops call --------------------------------------------------------------------------------
    def shape_of(self, ds_id: int) -> tuple[torch.Size, torch.dtype]:
        param = self.params[ds_id]
        return param.ds_shape, param.ds_tensor.dtype

    def _start(self, param: torch.nn.Parameter, async_op: bool) -> tuple[torch.Tensor, Any]:
        if self.param_moves is not None:
            self.param_moves.ensure_resident(param.ds_id)
        shard = param.ds_tensor
        world = param.ds_world_size
        if world == 1:
            return shard.clone(), None
        buffer = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
        work = comm.all_gather_into_tensor(buffer, shard, group=param.ds_process_group, async_op=async_op)
        self.stats.gathers += 1
        return buffer, work if async_op else None

    def prefetch(self, ds_id: int) -> None:
        """Start gathering ``ds_id`` without waiting (the prefetch pass puts this ahead of its use)."""
        if ds_id in self._inflight or ds_id in self._kept:
            return
        self._inflight[ds_id] = self._start(self.params[ds_id], async_op=True)
        self.stats.prefetched += 1
        self._note("prefetch", ds_id)

    def allgather(self, ds_id: int) -> torch.Tensor:
        """The full value of parameter ``ds_id``, in a buffer no one else holds."""
        param = self.params[ds_id]
        self._sync("before_allgather")
        if ds_id in self._kept:
            self.stats.persistent_hits += 1
            full = self._kept[ds_id].clone()  # the graph may write into what an op returns
        else:
            inflight = self._inflight.pop(ds_id, None)
            started = time.perf_counter()
            buffer, work = inflight or self._start(param, async_op=False)
            if work is not None:
                work.wait()
            if inflight is None:
                self.gather_seconds[ds_id] = time.perf_counter() - started
            full = buffer[:param.ds_numel].view(param.ds_shape)
            if ds_id in self.persistent:
                self._kept[ds_id] = full.clone()
        self.stats.live_numel += param.ds_numel
        self.stats.peak_live_numel = max(self.stats.peak_live_numel, self.stats.live_numel)
        self._note("gather", ds_id)
        self._sync("after_allgather")
        return full

    def release(self, ds_id: int) -> None:
        self.stats.releases += 1
        self.stats.live_numel = max(0, self.stats.live_numel - self.params[ds_id].ds_numel)
        self._note("release", ds_id)

    def reload_param(self, ds_id: int) -> None:
        if self.param_moves is not None:
            self.param_moves.reload(ds_id)
            self._note("reload", ds_id)

    def offload_param(self, ds_id: int) -> None:
        if self.param_moves is not None:
            self.param_moves.offload(ds_id)
            self._note("offload", ds_id)

    def reduce_grad(self, ds_id: int, grad: torch.Tensor) -> None:
        param = self.params[ds_id]
        if self.reduce is None or self.profiling or not param.requires_grad:
            return
        self._sync("before_reduce")
        self.stats.reduced += 1
        self._note("reduce", ds_id)
        dtype = self.expected_grad_dtype.get(ds_id)
        grad = grad.detach()  # a copy below: the compiled graph may reuse the gradient's buffer
        if self.wait_reduces is not None:  # the buffer this gradient fills: its last reduction done first
            self.wait_reduces(self.reduce_buffers - 1)
        self.reduce(param, grad.clone() if dtype is None or grad.dtype == dtype else grad.to(dtype))
        self._count_reduces_in_flight()
        self._sync("after_reduce")

    def end_backward(self, graph_id: int, release_reduce_buckets: bool) -> None:
        """A backward graph's reductions have all run (DeepSpeed's ``end_backward``); the last backward graph of a
        step launches the pending buckets (``release_reduce_buckets``)."""
        self.stats.backward_ends += 1
        if release_reduce_buckets and self.release_buckets is not None and not self.profiling:
            self.stats.bucket_releases += 1
            self.release_buckets()
            self._count_reduces_in_flight()

    def _count_reduces_in_flight(self) -> None:
        if self.reduces_in_flight is not None:
            self.stats.peak_reduces_in_flight = max(self.stats.peak_reduces_in_flight, self.reduces_in_flight())

    def wait_all(self) -> None:
        """Finish prefetches no graph used (a forward that raised)."""
        for _, work in self._inflight.values():
            if work is not None:
                work.wait()
        self._inflight.clear()

    def _note(self, op: str, ds_id: int) -> None:
        if self.record_order:
            self.stats.order.append((op, ds_id))


_HANDLE = DeepCompileHandle()


def get_deepcompile_handle() -> DeepCompileHandle:
    """The process's DeepCompile handle (DeepSpeed's name; there one C++ object per process too)."""
    return _HANDLE
