"""The first thing every rank runs: ``python -m dsrun.launcher.rank_exec [OPTIONS] -- COMMAND...``.

Options: ``--core_groups=0,1/2,3`` (one ``/``-separated core group per local rank) with ``--local_rank=N``
(which group is this rank's). Started by ``mpirun``/``jsrun`` (the MPI runners) instead of a dsrun agent,
``--mpi`` makes it read the rank from the MPI library's environment and set what a dsrun agent would:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``/``LOCAL_SIZE``, ``CROSS_RANK``/``CROSS_SIZE``
(from ``--world_info``, the job's hosts and slots), ``OMP_NUM_THREADS`` (cores / local ranks unless set),
``--chdir=DIR``, core binding with ``--bind_cores_to_rank [--bind_core_list=LIST]``, and ``--local_rank=N``
appended to the command with ``--append_local_rank``.

It arranges for the rank to die with its parent (``PR_SET_PDEATHSIG``, so an agent killed with SIGKILL
leaves no orphan ranks behind), applies core binding when the launcher asked for it, and then replaces
itself with the user's command (``execvp``), so the rank's PID, exit code and signals are the command's own.
Under an agent, torch elastic's ``GROUP_RANK``/``GROUP_WORLD_SIZE`` (the node's place in the current
rendezvous round, which changes in an elastic job) become ``CROSS_RANK``/``CROSS_SIZE``.
Kept free of heavy imports: it costs one bare interpreter start per rank.
"""
from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import sys

from dsrun.launcher.core_binding import cores_for_ranks
from dsrun.launcher.protocol import RANK_ENV

_PR_SET_PDEATHSIG = 1
# (rank, world size, local rank, local size) variables of each MPI family, in the order they are tried:
# Open MPI (also IBM Spectrum MPI under jsrun), MVAPICH2, jsrun's own, and MPICH / Intel MPI (Hydra's PMI)
MPI_VARIABLES: tuple[tuple[str, str, str | None, str | None], ...] = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


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


def _parse_core_list(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def mpi_rank_environment(environ: dict[str, str], hosts: dict[str, list[int]] | None = None) -> dict[str, str]:
    """The variables a rank started by an MPI launcher gets: its place in the world from the MPI library's
    variables, the node's index from the job's ``hosts`` (``{host: [slots]}`` in rank order). Raises
    ``ValueError`` when no MPI family's variables are set."""
    for rank_var, size_var, local_var, local_size_var in MPI_VARIABLES:
        if environ.get(rank_var, "").isdigit() and environ.get(size_var, "").isdigit():
            break
    else:
        names = ", ".join(f"{r}/{s}" for r, s, _, _ in MPI_VARIABLES)
        raise ValueError(f"not started by an MPI launcher: none of {names} is set")
    rank, world = int(environ[rank_var]), int(environ[size_var])
    counts = [len(slots) for slots in (hosts or {}).values()]  # ranks per node, in rank order
    node, first = 0, 0  # this rank's node and that node's first rank
    while node < len(counts) - 1 and rank >= first + counts[node]:
        first += counts[node]
        node += 1
    given_size, given_local = environ.get(local_size_var or "", ""), environ.get(local_var or "", "")
    if given_size.isdigit():
        local_size = int(given_size)
    else:
        local_size = counts[node] if counts else int(environ.get("LOCAL_SIZE", "1"))
    local = int(given_local) if given_local.isdigit() else (rank - first if counts else rank % local_size)
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_size),
            "LOCAL_SIZE": str(local_size), "CROSS_RANK": str(node), "CROSS_SIZE": str(len(counts) or 1)}


def _take_options(argv: list[str]) -> tuple[dict[str, str], list[str]] | None:
    options: dict[str, str] = {}
    while argv and argv[0] != "--":
        name, _, value = argv.pop(0).partition("=")
        if name not in ("--core_groups", "--local_rank", "--mpi", "--world_info", "--chdir", "--bind_cores_to_rank",
                        "--bind_core_list", "--append_local_rank"):
            print(f"dsrun.launcher.rank_exec: unknown option {name!r}", file=sys.stderr)
            return None
        options[name[2:]] = value
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m dsrun.launcher.rank_exec [--core_groups=0,1/2,3 --local_rank=N | --mpi ...] "
              "-- COMMAND [ARGS...]", file=sys.stderr)
        return None
    return options, argv[1:]


def main(argv: list[str] | None = None) -> int:
    taken = _take_options(list(sys.argv[1:] if argv is None else argv))
    if taken is None:
        return 2
    options, command = taken
    groups = _parse_core_groups(options["core_groups"]) if options.get("core_groups") else []
    local_rank = int(options.get("local_rank") or 0)
    if "mpi" in options:
        hosts = json.loads(base64.urlsafe_b64decode(options["world_info"])) if options.get("world_info") else None
        try:
            os.environ.update(mpi_rank_environment(dict(os.environ), hosts))
        except ValueError as err:
            print(f"dsrun: {err}", file=sys.stderr)
            return 2
        local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_SIZE"])
        if "bind_cores_to_rank" in options:
            core_list = _parse_core_list(options["bind_core_list"]) if options.get("bind_core_list") else None
            try:
                groups = cores_for_ranks(local_size, core_list)  # NUMA-aware: dsrun/launcher/core_binding.py
            except ValueError:
                groups = []
        elif "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // max(1, local_size)))
        if options.get("chdir"):
            os.chdir(options["chdir"])
        if "append_local_rank" in options:
            command = [*command, f"--local_rank={local_rank}"]
    elif os.environ.get("GROUP_RANK", "").isdigit():  # under a torch elastic agent
        os.environ["CROSS_RANK"] = os.environ["GROUP_RANK"]
        os.environ["CROSS_SIZE"] = os.environ.get("GROUP_WORLD_SIZE", os.environ.get("CROSS_SIZE", "1"))
    os.environ[RANK_ENV] = "1"  # dsrun in the rank reports a user's mistake to the launcher (protocol.py)
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
