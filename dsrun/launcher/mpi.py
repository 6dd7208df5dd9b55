"""Command lines of the MPI family of runners: ``mpirun`` (or ``jsrun``) starts every rank itself, in the
forms DeepSpeed's launcher uses, and no dsrun agent runs.

=========  ==================================================================================================
openmpi    ``mpirun -n N -hostfile HOSTFILE --mca btl ^openib --mca btl_tcp_if_include eth0 [LAUNCHER_ARGS]
           -x K=V ... RANK_CMD`` (``-H HOST:SLOTS,...`` instead of ``-hostfile`` when filters chose the hosts;
           no ``btl_tcp_if_include`` of dsrun's when ``LAUNCHER_ARGS`` sets one)
mpich      ``mpirun -n N -ppn PPN [LAUNCHER_ARGS] -genv K V ... -hosts HOST,HOST RANK_CMD``
impi       ``mpirun -n N -ppn PPN [LAUNCHER_ARGS] -genv K V ... -genv I_MPI_PIN 0 -hosts HOST,HOST RANK_CMD``
mvapich    ``mpirun -np N -ppn PPN --hostfile HOSTS_FILE [LAUNCHER_ARGS] -env K=V ... RANK_CMD``
jsrun      ``jsrun -n N -c 7 -g 1 -a 1 [LAUNCHER_ARGS] -E K=V ... RANK_CMD``
=========  ==================================================================================================

Every form exports the launcher's environment (:mod:`~dsrun.launcher.environment`) plus ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE`` and ``LOCAL_SIZE``; mvapich adds DeepSpeed's ``MV2_*`` settings and impi
turns Intel MPI's own pinning off (``I_MPI_PIN=0``) so ``--bind_cores_to_rank`` decides. ``RANK_CMD`` is
``PYTHON -u -m dsrun.launcher.rank_exec --mpi ... -- PYTHON -u SCRIPT ARGS`` (``-m MODULE`` with
``--module``, the bare program with ``--no_python``): the shim reads the rank from the MPI library
(``OMPI_COMM_WORLD_*``, ``MV2_COMM_WORLD_*``, ``JSM_NAMESPACE_*``, ``PMI_RANK``/``MPI_LOCALRANKID``) and sets
``RANK``/``LOCAL_RANK``/... before the script starts, so ``env://`` initialisation works without mpi4py;
the script still runs inside the MPI job (mpi4py sees the communicator). Failure handling is mpirun's:
one rank's non-zero exit aborts the job.
"""
from __future__ import annotations

import shlex

from dsrun.launcher.options import LaunchOptions
from dsrun.launcher.protocol import encode_world_info

# DeepSpeed's MVAPICH2 settings: no CMA kernel module, backtraces on failure, deep-learning support, no
# affinity of its own (MPI_THREAD_MULTIPLE), allgather tuning; MV2_USE_CUDA=1 is added on CUDA machines.
MVAPICH_EXPORTS: dict[str, str] = {"MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1", "MV2_SUPPORT_DL": "1",
                                   "MV2_ENABLE_AFFINITY": "0", "MV2_INTER_ALLGATHER_TUNING": "5",
                                   "MV2_CUDA_USE_NAIVE": "0"}
OPENMPI_TCP_INTERFACE = ("--mca", "btl_tcp_if_include", "eth0")  # DeepSpeed's default; --launcher_args overrides
JSRUN_RESOURCE_SET = ("-c", "7", "-g", "1", "-a", "1")  # a Summit node's 42 cores and 6 GPUs, one rank per GPU


def tcp_interface(launcher_args: list[str]) -> list[str]:
    """Open MPI's TCP interface, as DeepSpeed's launcher sets it: ``--mca btl_tcp_if_include eth0`` unless the
    launcher arguments choose one (``-mca``/``--mca btl_tcp_if_include IF``)."""
    for flag, name in zip(launcher_args, launcher_args[1:]):
        if flag in ("-mca", "--mca") and name == "btl_tcp_if_include":
            return []
    return list(OPENMPI_TCP_INTERFACE)


def rank_command(options: LaunchOptions, hosts: dict[str, list[int]]) -> list[str]:
    """What mpirun starts for every rank: the shim, then the user's program."""
    shim = [options.python, "-u", "-m", "dsrun.launcher.rank_exec", "--mpi", f"--world_info={encode_world_info(hosts)}",
            f"--chdir={options.cwd}"]
    if options.bind_cores_to_rank:
        shim.append("--bind_cores_to_rank")
        if options.bind_core_list:
            shim.append(f"--bind_core_list={options.bind_core_list}")
    if not options.no_local_rank:
        shim.append("--append_local_rank")
    if options.no_python:
        program = [options.target]
    else:
        program = [options.python, "-u", *(["-m"] if options.module else []), options.target]
    return [*shim, "--", *program, *options.target_args]


def job_exports(master_addr: str, master_port: int, hosts: dict[str, list[int]], env: dict[str, str]) -> dict[str, str]:
    per_node = len(next(iter(hosts.values())))
    return {**env, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(sum(len(s) for s in hosts.values())), "LOCAL_SIZE": str(per_node)}


def mpi_argv(runner: str, options: LaunchOptions, hosts: dict[str, list[int]], master_addr: str,
             env: dict[str, str], hostfile: str | None, hosts_file: str | None, cuda: bool = False) -> list[str]:
    """The whole command line for ``runner``. ``hostfile`` is the user's hostfile when the job uses all of
    it (Open MPI reads it as is); ``hosts_file`` is where the plan writes mvapich's list of hosts."""
    total = str(sum(len(s) for s in hosts.values()))
    per_node = str(len(next(iter(hosts.values()))))
    names = ",".join(hosts)
    extra = shlex.split(options.launcher_args)
    exports = job_exports(master_addr, int(options.master_port or 0), hosts, env)
    command = rank_command(options, hosts)
    if runner == "openmpi":
        where = ["-hostfile", hostfile] if hostfile else ["-H", ",".join(f"{h}:{len(s)}" for h, s in hosts.items())]
        binding = ["--bind-to", "none"] if options.bind_cores_to_rank else []  # dsrun binds each rank itself
        return ["mpirun", "-n", total, *where, "--mca", "btl", "^openib", *tcp_interface(extra), *binding, *extra,
                *[arg for k, v in exports.items() for arg in ("-x", f"{k}={v}")], *command]
    if runner in ("mpich", "impi"):
        pin = {"I_MPI_PIN": "0"} if runner == "impi" else {}
        return ["mpirun", "-n", total, "-ppn", per_node, *extra,
                *[arg for k, v in {**exports, **pin}.items() for arg in ("-genv", k, v)], "-hosts", names, *command]
    if runner == "mvapich":
        mv2 = {**MVAPICH_EXPORTS, **({"MV2_USE_CUDA": "1"} if cuda else {})}
        return ["mpirun", "-np", total, "-ppn", per_node, "--hostfile", str(hosts_file), *extra,
                *[arg for k, v in {**mv2, **exports}.items() for arg in ("-env", f"{k}={v}")], *command]
    if runner == "jsrun":
        return ["jsrun", "-n", total, *JSRUN_RESOURCE_SET, *extra,
                *[arg for k, v in exports.items() for arg in ("-E", f"{k}={v}")], *command]
    raise ValueError(f"not an MPI runner: {runner}")
