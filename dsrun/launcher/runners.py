"""Command lines for each runner: how the per-node agent gets started on every node.

Every runner starts the same thing on a node, :func:`node_command`: ``cd CWD && exec env K=V ... PYTHON -u
-m dsrun.launcher.agent FLAGS TARGET ARGS``, with every piece quoted for the remote shell. They differ in
how that string reaches the nodes:

=========  ===============================================================================================
local      ``/bin/sh -c CMD`` on this machine (one node)
no_ssh     ``/bin/sh -c CMD`` on this machine, for the node given by ``--node_rank``; run one per node
ssh        one ``ssh -o BatchMode=yes [-p PORT] [LAUNCHER_ARGS] HOST CMD`` per node, in parallel
pdsh       ``pdsh -S -f 1024 -w HOST,HOST [LAUNCHER_ARGS] CMD`` (pdsh puts the node index into ``%n``)
slurm      ``srun --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=... [--comment C] [--account A]
           [LAUNCHER_ARGS] /bin/sh -c CMD``
=========  ===============================================================================================

With slurm one agent runs per node and reads its node rank from ``SLURM_NODEID``; the agent, not srun, starts
the ranks, so failure handling is the same as with ssh. The MPI family (openmpi, mpich, impi, mvapich, jsrun)
has mpirun start every rank, as DeepSpeed does: :mod:`dsrun.launcher.mpi`.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from dsrun.launcher.mpi import mpi_argv
from dsrun.launcher.options import MPI_RUNNERS, STOP_MARGIN, LaunchOptions
from dsrun.launcher.protocol import encode_world_info

SSH_OPTIONS: tuple[str, ...] = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
                                "-o", "ServerAliveCountMax=3")
NODE_RANK_FROM_SCHEDULER = -1
PDSH_NODE_RANK = "%n"
# the program each runner needs on this machine's PATH
RUNNER_TOOLS: dict[str, str] = {"ssh": "ssh", "pdsh": "pdsh", "slurm": "srun", "openmpi": "mpirun", "mpich": "mpirun",
                                "impi": "mpirun", "mvapich": "mpirun", "jsrun": "jsrun"}


def runner_environment(runner: str, options: LaunchOptions, environ: dict[str, str]) -> dict[str, str]:
    """The environment the launcher starts the runner's command in: ``environ``, plus (pdsh) ssh as pdsh's
    remote shell unless the user chose another, and the ssh port for it."""
    env = dict(environ)
    if runner == "pdsh":
        env.setdefault("PDSH_RCMD_TYPE", "ssh")
        if options.ssh_port:
            env["PDSH_SSH_ARGS_APPEND"] = f"-p {options.ssh_port}"
    return env


@dataclass(frozen=True)
class NodeCommand:
    """One process the launcher starts on this machine: ``argv``, covering the nodes in ``hosts``."""

    hosts: tuple[str, ...]
    argv: tuple[str, ...]
    node_rank: int | None  # None: the command covers several nodes (pdsh, slurm, mpirun)

    @property
    def label(self) -> str:
        return ",".join(self.hosts)

    def display(self) -> str:
        """The command as a user would type it."""
        if self.argv[:2] == ("/bin/sh", "-c"):
            return self.argv[2]
        return shlex.join(self.argv)


def agent_argv(options: LaunchOptions, hosts: dict[str, list[int]], node_rank: int | str, master_addr: str,
               *, watch_stdin: bool = False, save_pid: int = 0) -> list[str]:
    """``PYTHON -u -m dsrun.launcher.agent ...`` for one node (or ``%n`` / -1 for the scheduler's rank)."""
    argv = [options.python, "-u", "-m", "dsrun.launcher.agent", f"--world_info={encode_world_info(hosts)}",
            f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={options.master_port}"]
    for flag in ("module", "no_python", "no_local_rank", "bind_cores_to_rank"):
        if getattr(options, flag):
            argv.append(f"--{flag}")
    if options.bind_core_list:
        argv.append(f"--bind_core_list={options.bind_core_list}")
    if options.restarts():
        argv.append(f"--max_restarts={options.restarts()}")
    if options.elastic_training:
        low, high = options.elastic_range(len(hosts))
        argv += ["--elastic_training", f"--min_elastic_nodes={low}", f"--max_elastic_nodes={high}",
                 f"--rdzv_last_call_timeout={options.rdzv_last_call_timeout:g}",
                 f"--rdzv_keep_alive_interval={options.keep_alive_interval()}"]
    if options.log_dir:
        argv.append(f"--log_dir={options.log_dir}")
    if options.stop_grace is not None:
        argv.append(f"--stop_grace={math.ceil(options.stop_grace + STOP_MARGIN)}")
    if save_pid:
        argv.append(f"--save_pid={save_pid}")
    if watch_stdin:
        argv.append("--watch_stdin")
    argv.append(options.target)
    argv.extend(options.target_args)
    return argv


def node_command(options: LaunchOptions, env: dict[str, str], argv: list[str]) -> str:
    """The shell command that runs ``argv`` on a node: change to the working directory, set ``env``."""
    command = f"cd {shlex.quote(options.cwd)} && exec "
    if env:
        command += "env " + " ".join(shlex.quote(f"{name}={value}") for name, value in env.items()) + " "
    return command + shlex.join(argv)


def ssh_argv(options: LaunchOptions, host: str, command: str) -> list[str]:
    argv = ["ssh", *SSH_OPTIONS]
    if options.ssh_port:
        argv += ["-p", str(options.ssh_port)]
    argv += shlex.split(options.launcher_args)
    return [*argv, host, command]


def pdsh_argv(options: LaunchOptions, hosts: list[str], command: str) -> list[str]:
    return ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), *shlex.split(options.launcher_args), command]


def srun_argv(options: LaunchOptions, hosts: list[str], command: str) -> list[str]:
    """srun command that starts one agent per node."""
    n = str(len(hosts))
    head = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}"]
    for flag in ("comment", "account"):
        if getattr(options, flag):
            head += [f"--{flag}", getattr(options, flag)]
    return [*head, *shlex.split(options.launcher_args), "/bin/sh", "-c", command]


def build_commands(runner: str, options: LaunchOptions, hosts: dict[str, list[int]], master_addr: str,
                   env: dict[str, str], save_pid: int = 0, *, hostfile: str | None = None,
                   hosts_file: str | None = None, cuda: bool = False) -> list[NodeCommand]:
    """The processes the launcher starts on this machine for ``runner``. For the MPI runners ``hostfile`` is
    the user's hostfile when the job uses every slot of it, ``hosts_file`` where mvapich's host list goes."""
    names = list(hosts)
    if runner in MPI_RUNNERS:
        return [NodeCommand(tuple(names), tuple(mpi_argv(runner, options, hosts, master_addr, env, hostfile,
                                                          hosts_file, cuda)), None)]
    if runner in ("local", "no_ssh"):
        node_rank = options.node_rank if runner == "no_ssh" and options.node_rank is not None else 0
        argv = agent_argv(options, hosts, node_rank, master_addr, save_pid=save_pid)
        return [NodeCommand((names[node_rank],), ("/bin/sh", "-c", node_command(options, env, argv)), node_rank)]
    if runner == "ssh":
        commands = []
        for node_rank, host in enumerate(names):
            argv = agent_argv(options, hosts, node_rank, master_addr, watch_stdin=True, save_pid=save_pid)
            commands.append(NodeCommand((host,), tuple(ssh_argv(options, host, node_command(options, env, argv))),
                                        node_rank))
        return commands
    if runner == "pdsh":
        argv = agent_argv(options, hosts, PDSH_NODE_RANK, master_addr, save_pid=save_pid)
        return [NodeCommand(tuple(names), tuple(pdsh_argv(options, names, node_command(options, env, argv))), None)]
    argv = agent_argv(options, hosts, NODE_RANK_FROM_SCHEDULER, master_addr, save_pid=save_pid)
    return [NodeCommand(tuple(names), tuple(srun_argv(options, names, node_command(options, env, argv))), None)]
