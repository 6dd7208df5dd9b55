"""Overlapping an offloaded optimizer step with the data movement around it.

:class:`StepPipeline` runs ``fetch(i + 1)`` (bring tile i+1's gradient to the host and scale it) and
``store(i - 1)`` (send tile i-1's updated 16-bit values to the device) on one background thread while the
main thread runs ``compute(i)`` (the compiled CPU optimizer, which releases the GIL). On CUDA the copies are
asynchronous anyway; on a CPU-only machine the same code path runs with the copies on the worker thread.

:func:`run_swap_pipeline` orders the NVMe step: reads of sub-group i+1 and writes of sub-group i-1 are in
flight on the async I/O threads while sub-group i is updated, with as many slots as the buffers allow.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

if TYPE_CHECKING:
    from dsrun.ops.cpu_optimizer import CPUOptimizer


@dataclass
class PipelineTimes:
    """Seconds the main thread spent in each part of the last step (``waiting`` = blocked on I/O or copies),
    and how many units (tiles or sub-groups) it stepped."""

    compute: float = 0.0
    waiting: float = 0.0
    total: float = 0.0
    units: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class StepPipeline:
    """fetch / compute / store over ``n`` units, with fetch ahead and store behind on one worker thread."""

    def __init__(self, overlap: bool = True):
        self.overlap = overlap
        self._worker: ThreadPoolExecutor | None = None
        self.times = PipelineTimes()

    def _pool(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsrun-offload")
        return self._worker

    def run(self, n: int, fetch: Callable[[int], None], compute: Callable[[int], None],
            store: Callable[[int], None] | None = None) -> PipelineTimes:
        times = PipelineTimes(units=n)
        start = time.perf_counter()
        if not self.overlap or n <= 1:
            for i in range(n):
                fetch(i)
                t = time.perf_counter()
                compute(i)
                times.compute += time.perf_counter() - t
                if store is not None:
                    store(i)
            times.total = time.perf_counter() - start
            self.times = times
            return times
        pool = self._pool()
        futures: list[Future] = []
        try:
            ahead = pool.submit(fetch, 0)
            futures.append(ahead)
            for i in range(n):
                t = time.perf_counter()
                ahead.result()
                times.waiting += time.perf_counter() - t
                if i + 1 < n:
                    ahead = pool.submit(fetch, i + 1)
                    futures.append(ahead)
                t = time.perf_counter()
                compute(i)
                times.compute += time.perf_counter() - t
                if store is not None:
                    futures.append(pool.submit(store, i))
            t = time.perf_counter()
            for f in futures:
                f.result()
            times.waiting += time.perf_counter() - t
        finally:
            for f in futures:  # never leave the worker writing into buffers after an error
                if not f.done():
                    f.cancel()
                    try:
                        f.result()
                    except Exception:
                        pass
        times.total = time.perf_counter() - start
        self.times = times
        return times

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def tiles(numel: int, tile: int) -> list[tuple[int, int]]:
    """[a, b) ranges of at most ``tile`` elements covering ``numel``."""
    return [(a, min(numel, a + tile)) for a in range(0, numel, tile)] if numel else []


TileFn = Callable[[int, int, int, int], Any]  # (unit, job, a, b)


def tiled_cpu_step(pipeline: StepPipeline, cpu_optimizer: CPUOptimizer, jobs: Sequence[tuple[dict, torch.Tensor]],
                   tile: int, grad: TileFn, low: Optional[TileFn] = None,
                   store: Optional[TileFn] = None) -> PipelineTimes:
    """One step of the compiled CPU optimizer over host masters (fp32, or fp16 ones updated directly with fp32
    moments: ``fp16.fp16_master_weights_and_grads``), ``tile`` elements at a time.

    ``jobs`` are (param group, master) pairs; every master's step count advances once. Each unit is one tile
    [a, b) of job j: ``grad(u, j, a, b)`` returns its fp32 gradient (run ahead on the pipeline's worker),
    ``low(u, j, a, b)`` where the update writes its rounded 16-bit copy (None: no copy), and
    ``store(u, j, a, b)`` sends the updated tile on (run behind on the worker)."""
    states, units = [], []
    for j, (_, master) in enumerate(jobs):
        state = cpu_optimizer.state_for(master, master_copy=False)  # the master is what the tiles update
        state["step"] += 1
        states.append(state)
        units += [(j, a, b) for a, b in tiles(master.numel(), tile)]
    fetched: dict[int, torch.Tensor] = {}

    def fetch(u: int) -> None:
        fetched[u] = grad(u, *units[u])

    def compute(u: int) -> None:
        j, a, b = units[u]
        group, master = jobs[j]
        state = states[j]
        cpu_optimizer.update_tile(group, master.detach()[a:b], fetched.pop(u),
                                  {k: state[k][a:b] for k in cpu_optimizer.STATE_KEYS}, state["step"],
                                  low_precision=None if low is None else low(u, j, a, b))

    put = None if store is None else (lambda u: store(u, *units[u]))
    return pipeline.run(len(units), fetch, compute, put)


def run_swap_pipeline(n: int, depth: int, issue_read: Callable[[int], None], wait_reads: Callable[[], None],
                      compute: Callable[[int], None], issue_write: Callable[[int], None],
                      wait_writes: Callable[[], None]) -> PipelineTimes:
    """Step ``n`` swapped sub-groups through ``depth`` buffer slots (sub-group i uses slot ``i % depth``).

    depth 3: read(i+1) and write(i-1) are in flight while compute(i) runs (read-ahead and write-behind);
    depth 2: read(i+1) overlaps compute(i), write(i) overlaps the wait for read(i+1);
    depth 1: read, compute, write one after the other.

    ``times.extra`` splits ``waiting`` into ``waiting_reads`` (blocked until a sub-group's files were read) and
    ``waiting_writes`` (until a slot's writes had landed, so it could be read into again).
    """
    times = PipelineTimes(units=n, extra={"waiting_reads": 0.0, "waiting_writes": 0.0})
    start = time.perf_counter()

    def waited(fn: Callable[[], None]) -> None:
        t = time.perf_counter()
        fn()
        spent = time.perf_counter() - t
        times.waiting += spent
        times.extra["waiting_reads" if fn is wait_reads else "waiting_writes"] += spent

    if n == 0:
        return times
    issue_read(0)
    waited(wait_reads)
    for i in range(n):
        if depth >= 2 and i + 1 < n:
            if depth == 2:
                waited(wait_writes)  # slot (i + 1) % 2 held sub-group i - 1: its write must be done
            issue_read(i + 1)
        t = time.perf_counter()
        compute(i)
        times.compute += time.perf_counter() - t
        if depth >= 3:
            waited(wait_writes)  # sub-group i - 1's write had compute(i) to finish; its slot is read next
        issue_write(i)
        if depth == 1:
            waited(wait_writes)
        if i + 1 < n:
            if depth == 1:
                issue_read(i + 1)
            waited(wait_reads)
    waited(wait_writes)
    times.total = time.perf_counter() - start
    return times


def scatter_to_shards(params: list[torch.nn.Parameter], offsets: list[int], start: int,
                      values: torch.Tensor, borrowed: bool = False) -> set[Any]:
    """Copy ``values`` (elements ``[start, start + len)`` of a sub-group) into the shards (``ds_tensor``) of
    the parameters laid out at ``offsets`` in that sub-group. ``borrowed``: a whole shard in NVMe files is
    written straight from ``values``; returns the parameter offloads whose writes still read it (to
    ``settle_borrowed()`` before ``values`` changes)."""
    end = start + values.numel()
    readers: set[Any] = set()
    with torch.no_grad():
        for p, off in zip(params, offsets):
            lo, hi = max(off, start), min(off + p.ds_partition_numel, end)
            if hi <= lo:
                continue
            owner = getattr(p, "ds_offload", None)
            if owner is not None and owner.swapped(p):  # offload_param nvme: staged, written once complete
                piece = values[lo - start:hi - start]
                if borrowed and hi - lo == p.ds_partition_numel:
                    if owner.write_borrowed(p, piece):
                        readers.add(owner)
                else:
                    owner.write_range(p, lo - off, hi - off, piece)
                continue
            target, source = p.ds_tensor[lo - off:hi - off], values[lo - start:hi - start]
            if target.data_ptr() != source.data_ptr():  # an aliased fp32 shard is the master itself
                target.copy_(source, non_blocking=True)
    return readers
