"""``dsrun train`` as one rank of a job an outer launcher started (torchrun, srun, mpirun): docs/torchrun.md.

Every rank composes the recipe and checks its ``launcher`` keys against the outer launcher's world
(:func:`dsrun.launcher.outer.launcher_conflicts`) on its own, so a conflict stops every rank with the same one
line before any of them waits for another. Then the ranks meet (:func:`join_world`: ``torch.distributed``'s
``env://`` rendezvous at the outer launcher's ``MASTER_ADDR:MASTER_PORT``, or the store a submitted Slurm job's
rank 0 opened, :mod:`dsrun.cli.submitted`) and only rank 0 goes on as ``dsrun
train`` does: Hydra makes the run directory (time-stamped, or ``hydra.run.dir``), the checks before launch run,
the run files are written. Rank 0 hands the directory to the others (:class:`RunHandoff`), so every rank
uses rank 0's and the others never run Hydra (no second directory, none of rank 0's files written twice); a
failure on rank 0 before that hands over its exit code instead, and the others leave with it. Each rank then
runs the worker's per-rank entry (``dsrun.worker``'s ``main``, the module the launcher starts) in this process,
its output also kept in ``logs/rank<R>.stdout.log`` / ``.stderr.log`` as dsrun's agent keeps it.

The run directory must be one every node reads and writes at the same path (a shared volume), as checkpoints
need anyway: the other ranks read ``resolved.yaml`` from it.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator

from dsrun.launcher.outer import OuterRank
from dsrun.runspec import WORKER_MODULE
from dsrun.utils.errors import EXIT_USAGE, UserError

if TYPE_CHECKING:
    from torch.distributed import Store


def join_world(outer: OuterRank, store: Store | None = None) -> None:
    """Give this process the variables a rank of dsrun's own launcher has, then meet the other ranks (on
    ``store`` when given: a submitted Slurm job's, :mod:`dsrun.cli.submitted`)."""
    import dsrun

    os.environ.update(outer.environment())
    if store is None:
        dsrun.init_distributed()
    else:
        dsrun.init_distributed(rank=outer.rank, world_size=outer.world_size, store=store)


class RunHandoff:
    """Rank 0's side: the run directory once it is written, or the exit code when rank 0 stops before."""

    def __init__(self) -> None:
        self.sent = False

    def _send(self, message: dict) -> None:
        from dsrun import comm
        from dsrun.comm.comm import comms_logger

        with comms_logger.uncounted():  # the launcher's plumbing: dsrun's own launcher passes it in argv
            comm.broadcast_object_list([message], src=0)
        self.sent = True

    def send_run(self, run_dir: Path) -> None:
        self._send({"run_dir": str(run_dir.resolve())})

    def close(self, error: BaseException | None) -> None:
        """Tell the others rank 0 stopped (``error``: why; None: it returned without a run) unless the run was sent."""
        from dsrun import comm

        if self.sent or not comm.is_initialized():  # sent, or refused before the ranks met (each rank did)
            return
        if isinstance(error, SystemExit):
            code = error.code if isinstance(error.code, int) else 1
        else:
            code = EXIT_USAGE if isinstance(error, UserError) else 1
        self._send({"exit_code": code or 0})


def follow_rank_zero() -> int:
    """A rank other than 0: wait for rank 0's run directory and train as that run's rank; or leave with rank 0's
    exit code when it stopped before starting the run (it said why)."""
    from dsrun import comm
    from dsrun.comm.comm import comms_logger

    message: list = [None]
    with comms_logger.uncounted():
        comm.broadcast_object_list(message, src=0)
    if "exit_code" in message[0]:
        return int(message[0]["exit_code"])
    return run_rank(Path(message[0]["run_dir"]), comm.get_rank())


def run_rank(run_dir: Path, rank: int, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Train as this rank of the run in ``run_dir``: the worker's entry in this process (the module dsrun's
    launcher starts, named the same way), its output also in ``logs/rank<R>.*.log``. Returns its exit code."""
    worker = importlib.import_module(WORKER_MODULE)
    with rank_logs(run_dir / "logs", rank, out or sys.stdout, err or sys.stderr):
        return int(worker.main(["--run-dir", str(run_dir)]))


class _Tee:
    """A text stream that writes to the console (or a tee of it) and to a log file."""

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        self.console.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.console.fileno()


@contextlib.contextmanager
def rank_logs(log_dir: Path, rank: int, out: IO[str], err: IO[str]) -> Iterator[None]:
    """While the rank trains, what it prints goes to ``out``/``err`` and to ``log_dir/rank<R>.stdout.log`` /
    ``.stderr.log`` (the files dsrun's agent writes for its ranks)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    saved = sys.stdout, sys.stderr
    with open(log_dir / f"rank{rank}.stdout.log", "a", encoding="utf-8") as stdout_log, \
            open(log_dir / f"rank{rank}.stderr.log", "a", encoding="utf-8") as stderr_log:
        sys.stdout, sys.stderr = _Tee(out, stdout_log), _Tee(err, stderr_log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved
