"""Start a benchmark's ranks: ``world`` fresh spawned processes on this machine that form one gloo world.

The benchmarks that time or measure a real multi-rank run (compile_zero.py, core_binding.py, reshard_memory.py,
z3_faults.py) start their ranks here: each rank is ``target(rank, world, port, results, *args)`` in a process of
its own (spawned, so it imports torch afresh and its memory is its own), with ``results`` a queue it puts what it
measured on. :func:`rank_env` sets the variables ``torch.distributed``'s ``env://`` start reads.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import time
from typing import Any, Callable


def rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """This process's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``MASTER_*`` (one host), and
    ``extra`` variables."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


def run_ranks(target: Callable[..., None], world: int, *args: Any, results: int | None = None,
              timeout: float = 1800) -> list[Any]:
    """Run ``target(rank, world, port, queue, *args)`` in ``world`` spawned processes and return the first
    ``results`` items they put on ``queue`` (default: one per rank), in the order they came. Fails as soon as a
    rank exits with an error (instead of waiting out ``timeout`` for a result that will not come), or when
    ``timeout`` seconds pass; ranks still running then are killed."""
    from dsrun.utils.net import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, queue, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    wanted = world if results is None else results
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < wanted:
            try:
                got.append(queue.get(timeout=1.0))
                continue
            except queue_module.Empty:
                pass
            failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank(s) failed (rank, exit code): {failed}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(got)} of {wanted} rank results after {timeout:g} s")
        for proc in procs:
            proc.join(timeout=120)
            if proc.exitcode != 0:
                raise RuntimeError(f"a rank ended with exit code {proc.exitcode}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return got
