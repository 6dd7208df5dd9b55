"""The CPU-core split between training and an offloaded optimizer (ZenFlow's ``pt_reserved_cores_perc``,
SuperOffload's ``offload_optimizer.cpuadam_cores_perc``).

The optimizer step runs on a worker thread of its own (:class:`PinnedWorker`) whose CPU affinity is the
optimizer's share of this process's cores (``os.sched_setaffinity`` on Linux sets the calling thread's mask);
the OpenMP team the compiled CPU optimizer starts from that thread is created by it and inherits the mask.
Every other thread of the process (the training thread and torch's intra-op threads) is moved to the rest,
and torch's intra-op thread count is lowered to match, so forward/backward and the optimizer never compete
for a core. :meth:`PinnedWorker.close` gives every thread its old mask and torch its old thread count back.

The split follows DeepSpeed's: the first ``ceil(reserved * n)`` cores of the process's mask go to training,
the rest to the optimizer; when that leaves either side empty (one core, or a share of 0 or 1) both sides
keep every core (nothing to gain from isolating an empty side).
"""
from __future__ import annotations

import math
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class CoreSplit:
    """Which cores train (``training``) and which step the optimizer (``optimizer``)."""

    training: tuple[int, ...]
    optimizer: tuple[int, ...]

    @property
    def isolated(self) -> bool:
        return not set(self.training) & set(self.optimizer)


def split_cores(cores: list[int] | tuple[int, ...], training_share: float) -> CoreSplit:
    """The first ``ceil(training_share * len(cores))`` of ``cores`` (sorted) train, the rest step the optimizer."""
    optimizer, training = _split_affinity(sorted(cores), training_share)
    return CoreSplit(tuple(training), tuple(optimizer))


def _split_affinity(cores: list[int], pt_reserved_cores_perc: float) -> tuple[list[int], list[int]]:
    """DeepSpeed's ZenFlow helper (``runtime.zenflow.zenflow_utils``): ``(optimizer cores, training cores)``, the
    first ``ceil(pt_reserved_cores_perc * len(cores))`` of ``cores``, in their order, training. When that is none
    or all of them, both sides get every core (nothing to isolate)."""
    keep = math.ceil(pt_reserved_cores_perc * len(cores))
    if 0 < keep < len(cores):
        return list(cores[keep:]), list(cores[:keep])
    return list(cores), list(cores)


def process_cores() -> list[int]:
    """The cores this process may run on (its affinity mask; every core where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def thread_cores(native_id: int) -> set[int]:
    """The affinity mask of one thread of this process (``/proc/self/task/<id>/status``'s Cpus_allowed_list)."""
    text = open(f"/proc/self/task/{native_id}/status").read()
    line = next(ln for ln in text.splitlines() if ln.startswith("Cpus_allowed_list:"))
    cores: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def _process_threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


class PinnedWorker:
    """One thread that runs the optimizer's work on ``split.optimizer``'s cores, the rest of the process on
    ``split.training``'s. ``submit(fn)`` returns a Future; jobs run one at a time, in order."""

    def __init__(self, split: CoreSplit, name: str = "dsrun-optimizer"):
        self.split = split
        self.native_id: int | None = None
        self._saved: dict[int, set[int]] = {}
        self._threads_before = torch.get_num_threads()
        worker_ids: list[int] = []  # the initializer holds no reference to self, so a dropped worker is collected
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_pin_worker,
                                        initargs=(split.optimizer, worker_ids))
        self._pool.submit(lambda: None).result()  # the worker exists and is pinned before training is moved
        self.native_id = worker_ids[0]
        self._pin_training()
        # an engine dropped without destroy() still gives the process its cores back when it is collected
        self._restore = weakref.finalize(self, _restore_masks, self._saved, self._threads_before)

    def _pin_training(self) -> None:
        if not self.split.isolated or not hasattr(os, "sched_setaffinity"):
            return
        for tid in _process_threads():
            if tid == self.native_id:
                continue
            try:
                self._saved[tid] = set(os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, self.split.training)
            except OSError:  # the thread ended meanwhile
                self._saved.pop(tid, None)
        torch.set_num_threads(min(self._threads_before, len(self.split.training)))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._restore()


def _pin_worker(cores: tuple[int, ...], worker_ids: list[int]) -> None:
    worker_ids.append(threading.get_native_id())
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)  # pid 0: this thread only
    torch.set_num_threads(len(cores))  # this thread's OpenMP team size


def _restore_masks(saved: dict[int, set[int]], threads_before: int) -> None:
    """Every moved thread's old mask and torch's old thread count (once: :meth:`PinnedWorker.close` or the
    worker's collection, whichever comes first)."""
    for tid, cores in saved.items():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass
    saved.clear()
    torch.set_num_threads(threads_before)
