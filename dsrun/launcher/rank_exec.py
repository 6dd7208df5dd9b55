"""The first thing every rank runs: ``python -m dsrun.launcher.rank_exec [OPTIONS] -- COMMAND...``.

Options: ``--core_groups=0,1/2,3`` (one ``/``-separated core group per local rank) with ``--local_rank=N``
(which group is this rank's).

It arranges for the rank to die with its node agent (``PR_SET_PDEATHSIG``, so an agent killed with SIGKILL
leaves no orphan ranks behind), applies core binding when the launcher asked for it, and then replaces
itself with the user's command (``execvp``), so the rank's PID, exit code and signals are the command's own.
Kept free of heavy imports: it costs one bare interpreter start per rank.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The agent may have died between our fork and the prctl call; then nobody would ever signal us.
    if os.getppid() == 1:
        os._exit(1)


def _parse_core_groups(spec: str) -> list[list[int]]:
    return [[int(core) for core in group.split(",") if core] for group in spec.split("/")]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    groups: list[list[int]] = []
    local_rank = 0
    while argv and argv[0] != "--":
        option = argv.pop(0)
        if option.startswith("--core_groups="):
            groups = _parse_core_groups(option.split("=", 1)[1])
        elif option.startswith("--local_rank="):
            local_rank = int(option.split("=", 1)[1])
        else:
            print(f"dsrun.launcher.rank_exec: unknown option {option!r}", file=sys.stderr)
            return 2
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m dsrun.launcher.rank_exec [--core_groups=0,1/2,3 --local_rank=N] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    command = argv[1:]
    _die_with_parent()
    cores = groups[local_rank] if groups else []
    if cores:
        os.sched_setaffinity(0, cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"dsrun: cannot start {command[0]!r}: {err.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: execvp replaced this process


if __name__ == "__main__":
    sys.exit(main())
