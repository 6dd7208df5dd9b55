"""Decoupled checkpoint saves (``checkpoint.writer.decoupled: true``): training waits only for a snapshot of the
state in host memory; a background thread writes the files and publishes the checkpoint.

A save (:func:`dsrun.checkpoint.engine_io.save_staged`, on every rank) goes:

1. **Turn.** A save still in flight is waited for, at most :attr:`DecoupledWriter.max_wait_s` (default
   :data:`IN_FLIGHT_WAIT_S`); the ranks agree (one all-reduce on the training thread, where every rank is) and,
   if any rank's write is still running, every rank skips this save with a logged reason. A write that failed
   raises here, on every rank (or at :func:`drain`).
2. **Snapshot** (training waits): rank 0 creates the staging folder, then every rank runs the same file writer
   a synchronous save runs, with :func:`dsrun.checkpoint.atomic.capturing_writes`: each file's object is copied
   to host memory (:mod:`.snapshot`; pinned on CUDA), nothing is written. The collectives of that code (tag
   validation, features' files) run on the training thread, as in a synchronous save.
3. **Write** (a background thread, training goes on): each file under a temporary name, fsynced, renamed into
   the staging folder.
4. **Agree and publish** (same thread): the ranks agree that every rank's files are durable over a process
   group of their own, gloo, created once up front (at the first decoupled save, collectively, on the training
   thread). Two threads never share a group: the training thread's collectives use the run's groups, the writer
   thread only its own, so gloo never sees one group used from two threads. (The other design, agreeing at the
   next step boundary on the training thread, would publish a step late and add a collective to every step
   while a write runs.) Rank 0 then commits as a synchronous save does (the staging folder renamed to the tag,
   ``zero_to_fp32.py``, then ``latest``), and a second all-reduce tells every rank it did. A rank killed
   before that leaves ``latest`` naming the previous complete checkpoint; the staging folder is tidied by the
   next save.

Before the world is destroyed (:func:`dsrun.comm.before_destroy`), at ``engine.destroy()`` and when ``dsrun
train`` ends or is preempted, the write in flight is waited for, so the run's last checkpoint is durable and
published before the process exits. The writer thread is not a daemon: a script that just returns waits for
it too.

Test seams: the crash points :data:`dsrun.checkpoint.atomic.DECOUPLED_CRASH_POINTS` (``DSRUN_TEST_CRASH_AT``:
the process SIGKILLs itself on the writer thread at that point), and :attr:`DecoupledWriter.before_write`, a
callable the writer thread runs before its first file (a test holds the write there while training goes on).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dsrun import comm
from dsrun.accelerator import get_accelerator
from dsrun.utils.errors import Problem, UserError

from . import atomic
from .snapshot import HostPool, Snapshot

log = logging.getLogger("dsrun.checkpoint")

IN_FLIGHT_WAIT_S = 300.0  # how long a save waits for the one in flight before it is skipped (DeepSpeed's timeout)


@dataclass
class SaveJob:
    """One decoupled save of this rank: its captured files and, once ``done`` is set, how it went."""

    tag: str
    root: Path
    rank: int
    files: list[atomic.PendingFile]
    snapshot: Snapshot
    publish: Callable[[], None]  # rank 0's commit (the staging folder to the tag, then `latest`)
    discard: Callable[[], None]  # rank 0's cleanup after a failed write (the staging folders go)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    write_s: float | None = None  # from the snapshot's end to the published checkpoint (or the failure)
    bytes: int | None = None  # rank 0: the published tag folder's size
    error: BaseException | None = None


def enabled(checkpoint_config: object) -> bool:
    """Whether a config's ``checkpoint`` section asks for decoupled saves (``checkpoint.writer.decoupled``)."""
    writer_config = getattr(checkpoint_config, "writer", None)
    return writer_config is not None and bool(writer_config.decoupled)


def folder_bytes(path: Path) -> int:
    """The bytes of the files in ``path`` (a checkpoint's tag folder)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class DecoupledWriter:
    """This process's writer thread's owner (one per process: every engine of the process saves through it)."""

    def __init__(self) -> None:
        self.world, self.rank = comm.get_world_size(), comm.get_rank()
        # the writer thread's own group (module docstring, step 4); collective: every rank creates it here
        self.group = comm.new_group(backend="gloo") if self.world > 1 else None
        self.pool = HostPool(pinned=get_accelerator().pin_memory_enabled())  # the snapshots' buffers, reused
        self.job: SaveJob | None = None
        self.max_wait_s = IN_FLIGHT_WAIT_S
        self.before_write: Callable[[SaveJob], None] | None = None  # test seam (module docstring)

    def snapshot(self) -> Snapshot:
        return Snapshot(self.pool)

    def busy(self) -> bool:
        return self.job is not None and not self.job.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the write in flight (at most ``timeout`` seconds; None: until it ends); True when none runs."""
        return self.job is None or self.job.done.wait(timeout)

    def take_turn(self, device: torch.device) -> str | None:
        """Collective on the training thread, over the world (step 1; ``device``: where the world's collectives
        take tensors): None when this save may go ahead, else why every rank skips it. Raises the error of a
        previous write that failed. (Not the writer's group: its thread may still be using it.)"""
        waited = time.perf_counter()
        finished = self.wait(self.max_wait_s)
        if self.world > 1:
            running = torch.tensor([0.0 if finished else 1.0], device=device)
            comm.all_reduce(running, op=comm.ReduceOp.MAX)
            finished = running.item() == 0
        if not finished:
            tag, waited = (self.job.tag if self.job is not None else "?"), time.perf_counter() - waited
            return (f"the decoupled write of {tag} is still running on a rank after {waited:.1f} s (at most "
                    f"{self.max_wait_s:g} s waited): the saves come faster than the disk writes them; save less "
                    "often")
        self.raise_failure()
        return None

    def raise_failure(self) -> None:
        """Raise (once) the error the finished write met."""
        job = self.job
        if job is not None and job.done.is_set() and job.error is not None:
            self.job = None
            raise job.error

    def submit(self, job: SaveJob) -> None:
        """Start writing ``job`` in the background (the previous one has ended: :meth:`take_turn`)."""
        self.job = job
        threading.Thread(target=self._run, args=(job,), name="dsrun-checkpoint-writer").start()

    def _run(self, job: SaveJob) -> None:
        try:
            self._write_and_publish(job)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the next turn or drain
            job.error = exc
            log.error("decoupled checkpoint %s failed: %s", job.tag, exc)
        finally:
            job.write_s = time.perf_counter() - job.started
            self.pool.give_back(job.snapshot.taken)
            job.files, job.snapshot = [], Snapshot()  # the host copies go now
            job.done.set()

    def _agree(self, value: float, op: comm.ReduceOp = comm.ReduceOp.MAX) -> float:
        if self.group is None:
            return value
        flag = torch.tensor([value], dtype=torch.float64)
        comm.all_reduce(flag, op=op, group=self.group)
        return float(flag.item())

    def _write_and_publish(self, job: SaveJob) -> None:
        if self.before_write is not None:
            self.before_write(job)
        atomic.crash_point("decoupled_write_started", job.rank)
        error: Exception | None = None
        try:
            for pending in job.files:  # through the writer and in the format the save was asked for
                with atomic.writing_with(pending.writer), atomic.legacy_serialization(pending.legacy):
                    atomic.save_torch(pending.obj, pending.path, pending.rank, torn_point="decoupled_file_torn",
                                      pickle_module=pending.pickle_module)
        except Exception as exc:  # every rank must hear of it, or the others wait forever below
            error = exc
        if error is None:
            atomic.crash_point("decoupled_files_durable", job.rank)
        failed = self._agree(0.0 if error is None else 2.0 if atomic.disk_full(error) else 1.0)
        if failed:
            self._fail(job, error, full=failed == 2.0)
        failure: Exception | None = None
        if self.rank == 0:
            try:
                job.publish()
                job.bytes = folder_bytes(job.root / job.tag)
            except Exception as exc:  # noqa: BLE001 - the others learn of it below
                failure = exc
        if self._agree(0.0 if failure is None else 1.0) and failure is None:
            raise RuntimeError(f"publishing decoupled checkpoint {job.tag} failed on rank 0 (see its log)")
        if failure is not None:
            raise failure

    def _fail(self, job: SaveJob, error: Exception | None, full: bool) -> None:
        """Every rank raises after a failed write; rank 0 removes the staging folder. A full disk is one line with
        the bytes the save needs (its captured files counted again, writing nothing)."""
        needed = 0.0
        if full:
            with atomic.counting_bytes() as counted:
                for pending in job.files:
                    with atomic.legacy_serialization(pending.legacy):
                        atomic.save_torch(pending.obj, pending.path, pickle_module=pending.pickle_module)
            needed = self._agree(float(counted.bytes), comm.ReduceOp.SUM)
        if self.rank == 0:
            job.discard()
        if full:
            raise UserError(Problem("save_checkpoint", f"no space left on device while writing {job.tag} in {job.root} "
                                    f"in the background ({int(needed):,} bytes needed); nothing of it was kept",
                                    "free space there or save to a bigger disk; dsrun train: train.keep_last=N "
                                    "keeps fewer checkpoints")) from error
        if error is not None:
            raise error
        raise RuntimeError(f"decoupled checkpoint {job.tag}: the write failed on another rank (see its log); "
                           "nothing was committed")


_writer: DecoupledWriter | None = None


def writer() -> DecoupledWriter:
    """This process's writer, created at the first decoupled save (collective: every rank saves)."""
    global _writer
    if _writer is None:
        _writer = DecoupledWriter()
        comm.before_destroy(_forget)
    return _writer


def active() -> DecoupledWriter | None:
    """The writer, if a decoupled save was made in this process (nothing is created)."""
    return _writer


def drain(raise_failure: bool = True) -> None:
    """Wait for the write in flight (if any) to be durable and published; raise its error unless told not to."""
    if _writer is not None:
        _writer.wait()
        if raise_failure:
            _writer.raise_failure()


def _forget() -> None:
    """Before the world goes: finish the write (its group goes with the world) and start afresh next time."""
    global _writer
    drain(raise_failure=False)
    _writer = None
