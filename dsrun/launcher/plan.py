"""The world plan: which hosts and slots a job uses, who is master, and the command for every node.

:func:`plan_launch` turns :class:`~dsrun.launcher.options.LaunchOptions` into a :class:`LaunchPlan` and
checks everything it can without touching another machine. Ranks are numbered in hostfile order, then slot
order: with ``a slots=2`` and ``b slots=2`` ranks 0-1 run on ``a`` and 2-3 on ``b``.
"""
from __future__ import annotations

import glob
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsrun.launcher.environment import exported_environment
from dsrun.launcher.hostfile import Pool, apply_filters, parse_core_list, read_hostfile
from dsrun.launcher.options import DEFAULT_MASTER_PORT, MPI_RUNNERS, LaunchOptions
from dsrun.launcher.ray_options import RayOptions
from dsrun.launcher.runners import NodeCommand, build_commands
from dsrun.utils.errors import Problem, UserError
from dsrun.utils.net import free_port

DEFAULT_HOSTFILE = "/job/hostfile"
LOCAL_HOST = "localhost"


@dataclass
class LaunchPlan:
    """A job ready to run: ``hosts`` maps each host to the slot ids it runs ranks on, in rank order."""

    hosts: dict[str, list[int]]
    world_size: int
    master_addr: str
    master_port: int
    runner: str
    commands: list[NodeCommand]
    env: dict[str, str]
    options: LaunchOptions
    hostfile: str | None = None
    save_pid: int = 0
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # written before the commands start (mvapich's hosts)
    outer: str | None = None  # an outer launcher started the ranks (dsrun.launcher.outer): its world, described
    ray: RayOptions | None = None  # Ray Train starts the ranks (launcher=ray, dsrun.launcher.ray_options)

    def to_json(self) -> dict[str, Any]:
        """The plan as ``dsrun launch --dry-run`` prints it."""
        plan = {
            "hosts": {host: list(slots) for host, slots in self.hosts.items()},
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "launcher": self.runner,
            "commands": [[command.label, command.display()] for command in self.commands],
            "env": dict(self.env),
        }
        if self.options.elastic_training:
            low, high = self.options.elastic_range(len(self.hosts))
            plan["elastic"] = {"min_nodes": low, "max_nodes": high, "join": self.join_command()}
        if self.files:
            plan["files"] = dict(self.files)
        return plan

    def join_command(self) -> str:
        """How another node of the hostfile joins this elastic job: one per-node launcher, as in no-ssh mode
        (``NODE_RANK`` is its line in the hostfile: which address and how many slots it brings)."""
        o = self.options
        low, high = o.elastic_range(len(self.hosts))
        words = ["dsrun", "launch", "--elastic_training", f"--min_elastic_nodes={low}", f"--max_elastic_nodes={high}",
                 f"--rdzv_last_call_timeout={o.rdzv_last_call_timeout:g}",
                 f"--rdzv_keep_alive_interval={o.keep_alive_interval()}", "--no_ssh", "--node_rank", "NODE_RANK",
                 f"--master_addr={self.master_addr}", f"--master_port={self.master_port}"]
        if self.hostfile:
            words.append(f"--hostfile={os.path.join(o.cwd, self.hostfile)}")
        for flag in ("module", "no_python", "bind_cores_to_rank"):
            if getattr(o, flag):
                words.append(f"--{flag}")
        if o.max_restarts is not None:
            words.append(f"--max_restarts={o.max_restarts}")
        return shlex.join([*words, o.target, *o.target_args])


def _local_accelerators(environ: dict[str, str]) -> list[int] | None:
    """Visible GPU ids without importing torch: CUDA_VISIBLE_DEVICES, else /dev/nvidiaN; None on CPU."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [int(part) for part in visible.split(",") if part.strip().isdigit()]
        return ids or None
    devices = sorted(int(path[len("/dev/nvidia"):]) for path in glob.glob("/dev/nvidia[0-9]*")
                     if path[len("/dev/nvidia"):].isdigit())
    return devices or None


def _resource_pool(options: LaunchOptions, environ: dict[str, str]) -> tuple[Pool, str | None]:
    if options.hostfile:
        hostfile = options.hostfile
        if not os.path.isabs(hostfile):
            hostfile = os.path.join(options.cwd, hostfile)
        return {h: list(range(n)) for h, n in read_hostfile(hostfile).items()}, options.hostfile
    if os.path.isfile(DEFAULT_HOSTFILE):
        return {h: list(range(n)) for h, n in read_hostfile(DEFAULT_HOSTFILE).items()}, DEFAULT_HOSTFILE
    if options.num_nodes not in (None, -1, 1):
        raise UserError(Problem("--num_nodes", f"asks for {options.num_nodes} nodes but there is no hostfile",
                                "list the nodes in a hostfile and pass it with --hostfile"))
    gpus = _local_accelerators(environ)
    if options.num_procs not in (None, -1):
        return {LOCAL_HOST: list(range(options.num_procs))}, None
    if gpus is not None:
        return {LOCAL_HOST: gpus}, None
    if options.include or options.exclude:
        # On CPU a filter may name any of this machine's cores as slots.
        return {LOCAL_HOST: list(range(os.cpu_count() or 1))}, None
    return {LOCAL_HOST: [0]}, None  # CPU: one process unless told otherwise


def _select(pool: Pool, options: LaunchOptions, from_hostfile: bool) -> Pool:
    hosts = apply_filters(pool, options.include, options.exclude)
    problems: list[Problem] = []
    if options.num_nodes not in (None, -1):
        if options.num_nodes > len(hosts):
            problems.append(Problem("--num_nodes", f"asks for {options.num_nodes} nodes but the hostfile has "
                                    f"{len(hosts)}"))
        hosts = dict(list(hosts.items())[: options.num_nodes])
    if options.num_procs not in (None, -1) and from_hostfile:
        for host, slots in hosts.items():
            if options.num_procs > len(slots):
                problems.append(Problem("--num_procs", f"asks for {options.num_procs} ranks per node but host "
                                        f"{host!r} has {len(slots)} slots"))
        hosts = {host: slots[: options.num_procs] for host, slots in hosts.items()}
    if problems:
        raise UserError(problems)
    return {host: slots for host, slots in hosts.items() if slots}


def _strip_user(host: str) -> str:
    return host.split("@", 1)[1] if "@" in host else host


def master_port_for(options: LaunchOptions, runner: str) -> int:
    """The port given, else a free one for a single-node local job (two local jobs at once, such as the jobs
    of a multirun or two terminals, must not both take 29500), else DeepSpeed's 29500, which every node of
    a multi-node job can agree on without being told."""
    if options.master_port is not None:
        return options.master_port
    return free_port() if runner == "local" else DEFAULT_MASTER_PORT


def plan_launch(options: LaunchOptions, environ: dict[str, str] | None = None) -> LaunchPlan:
    """Check ``options`` and work out the job: hosts, world size, master, commands, exported environment.

    Raises :class:`~dsrun.utils.errors.UserError` listing every problem found.
    """
    environ = dict(os.environ if environ is None else environ)
    options.validate()
    pool, hostfile = _resource_pool(options, environ)
    hosts = _select(pool, options, from_hostfile=hostfile is not None)
    return plan_for_hosts(options, hosts, environ, pool=pool, hostfile=hostfile)


def plan_for_hosts(options: LaunchOptions, hosts: Pool, environ: dict[str, str], *, pool: Pool | None = None,
                   hostfile: str | None = None, exports: dict[str, str] | None = None) -> LaunchPlan:
    """The plan for ranks on ``hosts`` (already chosen): the checks, master, environment and commands of
    :func:`plan_launch`. ``pool`` is every slot of ``hostfile`` (Open MPI reads the hostfile itself when the
    job uses all of it); ``exports`` are variables to export beyond those the environment selects."""
    problems: list[Problem] = []
    runner = options.runner or ("local" if len(hosts) == 1 and not options.force_multi else "ssh")
    if runner == "local" and len(hosts) > 1:
        problems.append(Problem("--launcher", f"the local runner runs on this machine only, but the job spans "
                                f"{len(hosts)} hosts", "use ssh, pdsh, slurm, an MPI runner or --no_ssh"))
    if runner == "no_ssh" and options.node_rank is not None and options.node_rank >= len(hosts):
        problems.append(Problem("--node_rank", f"is {options.node_rank} but the job has {len(hosts)} nodes "
                                f"(0..{len(hosts) - 1})"))
    if runner == "no_ssh" and len(hosts) > 1 and not options.master_addr:
        problems.append(Problem("--master_addr", "is required with --no_ssh on several nodes",
                                "give node 0's address, the same on every node"))
    if runner in MPI_RUNNERS:
        problems += _mpi_problems(runner, hosts)
    if options.elastic_training:
        low, high = options.elastic_range(len(hosts))
        if high < len(hosts) and runner != "no_ssh":
            problems.append(Problem("--max_elastic_nodes", f"is {high}, but the job starts on {len(hosts)} nodes",
                                    f"raise it to at least {len(hosts)}, or use --num_nodes {high}"))
    if options.bind_core_list:
        try:
            cores = parse_core_list(options.bind_core_list)
            busiest = max(len(slots) for slots in hosts.values())
            if len(cores) < busiest:
                problems.append(Problem("--bind_core_list", f"has {len(cores)} cores for {busiest} ranks per node",
                                        "each rank needs at least one core"))
        except UserError as err:
            problems.extend(err.problems)
    if options.target and not (options.module or options.no_python):
        script = Path(options.target if os.path.isabs(options.target) else os.path.join(options.cwd, options.target))
        if runner in ("local", "no_ssh") and not script.is_file():
            problems.append(Problem("script", f"{options.target!r} does not exist",
                                    "pass a script path, or --module NAME for python -m"))
    if problems:
        raise UserError(problems)

    if options.master_addr:
        master_addr = options.master_addr
    elif runner == "local":
        master_addr = "127.0.0.1"
    else:
        master_addr = _strip_user(next(iter(hosts)))
    options.master_port = master_port_for(options, runner)
    if options.log_dir and not os.path.isabs(options.log_dir):
        options.log_dir = os.path.join(options.cwd, options.log_dir)
    env = dict(sorted({**exported_environment(options.cwd, environ), **(exports or {})}.items()))
    if runner not in ("local", "no_ssh"):
        # remote nodes start in the working directory but need it on the import path, as DeepSpeed does
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != options.cwd]
        env["PYTHONPATH"] = os.pathsep.join([options.cwd, *rest])
    save_pid = os.getpid() if options.save_pid else 0
    files: dict[str, str] = {}
    whole_hostfile = None
    if runner == "openmpi" and hostfile is not None and hosts == pool:
        whole_hostfile = hostfile if os.path.isabs(hostfile) else os.path.join(options.cwd, hostfile)
    if runner == "mvapich":
        hosts_file = os.path.join(tempfile.gettempdir(), f"dsrun-mvapich-hosts-{os.getpid()}")
        files[hosts_file] = "".join(f"{_strip_user(h)}\n" for h in hosts)
    commands = build_commands(runner, options, hosts, master_addr, env, save_pid=save_pid, hostfile=whole_hostfile,
                              hosts_file=next(iter(files), None), cuda=_local_accelerators(environ) is not None)
    return LaunchPlan(hosts=hosts, world_size=sum(len(s) for s in hosts.values()), master_addr=master_addr,
                      master_port=options.master_port, runner=runner, commands=commands, env=env,
                      options=options, hostfile=hostfile, save_pid=save_pid, files=files)


def _mpi_problems(runner: str, hosts: Pool) -> list[Problem]:
    """mpirun places ranks by count per host: it cannot skip slots, and (but for Open MPI's -H) every host
    must run as many ranks as the others."""
    problems = [Problem("--include/--exclude", f"host {host!r} would run on slots {slots}; the {runner} runner "
                        f"places ranks by count and cannot skip slots", "filter whole hosts, or use --num_procs")
                for host, slots in hosts.items() if slots != list(range(len(slots)))]
    counts = {len(slots) for slots in hosts.values()}
    if runner != "openmpi" and len(counts) > 1:
        problems.append(Problem("--hostfile", f"the {runner} runner needs the same number of ranks on every host, "
                                f"got {', '.join(f'{h}: {len(s)}' for h, s in hosts.items())}",
                                "use --num_procs N, or the openmpi runner"))
    return problems
