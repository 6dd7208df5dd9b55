"""What a user asks the launcher for: :class:`LaunchOptions`, built from ``dsrun launch`` flags or from the
``launcher:`` mapping of a RunSpec.

The RunSpec mapping (all keys optional)::

    launcher:
      runner: local            # local | ssh | pdsh | no_ssh | slurm | openmpi | mpich | impi | mvapich |
                               # jsrun (default: local for one host, ssh for several)
      num_procs: 2             # ranks per node (--num_procs/--num_gpus/--num_accelerators)
      num_nodes: null          # use the first N hosts of the hostfile
      hostfile: null           # path; default /job/hostfile when it exists, else this machine only
      include: null            # "host[:slot,slot]@host..."
      exclude: null
      master_addr: null        # default 127.0.0.1 for one host, else the first host
      master_port: null        # null: a free port for a local single-node run, else 29500
      node_rank: null          # required with runner no_ssh
      ssh_port: null
      launcher_args: ""        # extra options for ssh / pdsh / srun / mpirun
      bind_cores_to_rank: null # null: false, except that dsrun train binds offload runs (core_binding.py)
      bind_core_list: null     # "0-13,14-27"
      max_restarts: null       # null: 0, or 100 with elastic_training (DeepSpeed's)
      log_dir: null            # per-rank log files (--enable_each_rank_log)
      force_multi: false       # use the multi-node runner even for one host
      elastic_training: false  # nodes may leave and join (torch elastic's c10d rendezvous)
      min_elastic_nodes: null  # null: 1
      max_elastic_nodes: null  # null: the nodes planned
      rdzv_last_call_timeout: 30  # seconds an elastic rendezvous waits for more nodes once it has enough
      rdzv_keep_alive_interval: null  # seconds between an elastic node's heartbeats (null: 5); 3 missed: it left
      comment: null            # srun --comment (slurm)
      account: null            # srun --account (slurm)

Validation collects every problem at once and raises one :class:`~dsrun.utils.errors.UserError`.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from dsrun.utils.errors import Problem, UserError, show
from dsrun.utils.suggest import did_you_mean

RUNNERS: tuple[str, ...] = ("local", "ssh", "pdsh", "no_ssh", "slurm", "openmpi", "mpich", "impi", "mvapich", "jsrun")
# mpirun (or jsrun) starts every rank itself: no dsrun agent, so no elastic training and no slot subsets
MPI_RUNNERS: tuple[str, ...] = ("openmpi", "mpich", "impi", "mvapich", "jsrun")
# runners whose nodes each run a dsrun agent that dsrun itself starts, one command per node or per job
ELASTIC_RUNNERS: tuple[str, ...] = ("local", "ssh", "pdsh", "no_ssh")
DEFAULT_MASTER_PORT = 29500
ELASTIC_MAX_RESTARTS = 100  # DeepSpeed's elastic agent allows 100 restarts
DEFAULT_LAST_CALL_TIMEOUT = 30.0  # torch elastic's default
# seconds between an elastic node's rendezvous heartbeats (torch elastic's default); a node that misses
# KEEP_ALIVE_MISSES of them in a row has left its round
DEFAULT_KEEP_ALIVE_INTERVAL = 5
KEEP_ALIVE_MISSES = 3
# with a stop grace (dsrun train's train.preemption.grace_s): each supervisor waits this much beyond the one below
# it before it kills (a rank's own grace ends first, then the agent's, then the launcher's)
STOP_MARGIN = 5.0

# RunSpec key -> (LaunchOptions field, accepted Python types)
MAPPING_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "runner": ("runner", (str,)),
    "num_procs": ("num_procs", (int,)),
    "num_nodes": ("num_nodes", (int,)),
    "hostfile": ("hostfile", (str,)),
    "include": ("include", (str,)),
    "exclude": ("exclude", (str,)),
    "master_addr": ("master_addr", (str,)),
    "master_port": ("master_port", (int,)),
    "node_rank": ("node_rank", (int,)),
    "ssh_port": ("ssh_port", (int,)),
    "launcher_args": ("launcher_args", (str,)),
    "bind_cores_to_rank": ("bind_cores_to_rank", (bool,)),
    "bind_core_list": ("bind_core_list", (str,)),
    "max_restarts": ("max_restarts", (int,)),
    "log_dir": ("log_dir", (str,)),
    "force_multi": ("force_multi", (bool,)),
    "elastic_training": ("elastic_training", (bool,)),
    "min_elastic_nodes": ("min_elastic_nodes", (int,)),
    "max_elastic_nodes": ("max_elastic_nodes", (int,)),
    "rdzv_last_call_timeout": ("rdzv_last_call_timeout", (int, float)),
    "rdzv_keep_alive_interval": ("rdzv_keep_alive_interval", (int,)),
    "comment": ("comment", (str,)),
    "account": ("account", (str,)),
}


@dataclass
class LaunchOptions:
    """Everything the launcher needs to plan a job. ``None`` means "not given, use the default"."""

    target: str = ""                       # script path, module name (module=True) or executable (no_python)
    target_args: list[str] = field(default_factory=list)
    runner: str | None = None              # one of RUNNERS; None picks local (one host) or ssh
    num_procs: int | None = None
    num_nodes: int | None = None
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    master_addr: str | None = None
    master_port: int | None = None        # None: a free port (local runner) or DEFAULT_MASTER_PORT
    node_rank: int | None = None
    ssh_port: int | None = None
    launcher_args: str = ""
    no_ssh_check: bool = False
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    log_dir: str | None = None
    save_pid: bool = False
    max_restarts: int | None = None        # None: 0, or ELASTIC_MAX_RESTARTS with elastic_training
    force_multi: bool = False
    elastic_training: bool = False
    min_elastic_nodes: int | None = None   # None or -1: 1
    max_elastic_nodes: int | None = None   # None or -1: the number of nodes planned
    rdzv_last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT
    rdzv_keep_alive_interval: int | None = None  # None: DEFAULT_KEEP_ALIVE_INTERVAL
    comment: str | None = None
    account: str | None = None
    # seconds the ranks have to stop after a stop signal (dsrun train: train.preemption.grace_s); the agents kill
    # them STOP_MARGIN later, the launcher kills what is left STOP_MARGIN after that. None: the agents' 30 s, the
    # launcher's 40
    stop_grace: float | None = None
    cwd: str = field(default_factory=os.getcwd)
    python: str = sys.executable

    def problems(self) -> list[Problem]:
        """Every inconsistency among the options (the hostfile itself is checked when planning)."""
        found: list[Problem] = []
        if not self.target:
            found.append(Problem("script", "is missing", "give the script (or module with --module) to run"))
        if self.runner is not None and self.runner not in RUNNERS:
            found.append(Problem("--launcher", f"unknown runner {show(self.runner)}; expected one of "
                                 f"{', '.join(RUNNERS)}", did_you_mean(self.runner, RUNNERS)))
        for name in ("num_procs", "num_nodes"):
            value = getattr(self, name)
            if value is not None and value != -1 and value < 1:
                found.append(Problem(f"--{name}", f"must be at least 1 (or -1 for all), got {value}"))
        if self.include and self.exclude:
            found.append(Problem("--include/--exclude", "are mutually exclusive", "use one of them"))
        if (self.include or self.exclude) and (_given(self.num_nodes) or _given(self.num_procs)):
            flag = "--include" if self.include else "--exclude"
            found.append(Problem(flag, "cannot be combined with --num_nodes/--num_procs",
                                 "a filter already says which hosts and slots to use"))
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            found.append(Problem("--master_port", f"must be a TCP port 1..65535, got {self.master_port}"))
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            found.append(Problem("--ssh_port", f"must be a TCP port 1..65535, got {self.ssh_port}"))
        if self.max_restarts is not None and self.max_restarts < 0:
            found.append(Problem("--max_restarts", f"must be 0 or more, got {self.max_restarts}"))
        found += self._elastic_problems()
        for flag in ("comment", "account"):
            if getattr(self, flag) and self.runner != "slurm":
                found.append(Problem(f"--{flag}", f"is passed to srun, so it applies to the slurm runner only "
                                     f"(the runner is {self.runner or 'chosen by the hosts'})",
                                     "add --launcher slurm, or drop it"))
        if self.module and self.no_python:
            found.append(Problem("--module", "cannot be combined with --no_python"))
        if self.runner == "no_ssh":
            if self.node_rank is None:
                found.append(Problem("--node_rank", "is required with --no_ssh",
                                     "run one launcher per node with --node_rank 0, 1, ..."))
        elif self.node_rank is not None and self.runner not in (None, "local"):
            found.append(Problem("--node_rank", f"only applies with --no_ssh, not with the {self.runner} runner"))
        if self.node_rank is not None and self.node_rank < 0:
            found.append(Problem("--node_rank", f"must be 0 or more, got {self.node_rank}"))
        if self.bind_core_list and not self.bind_cores_to_rank:
            found.append(Problem("--bind_core_list", "needs --bind_cores_to_rank"))
        return found

    def _elastic_problems(self) -> list[Problem]:
        found: list[Problem] = []
        given = [f"--{name}" for name in ("min_elastic_nodes", "max_elastic_nodes")
                 if getattr(self, name) not in (None, -1)]
        given += ["--rdzv_keep_alive_interval"] if self.rdzv_keep_alive_interval is not None else []
        if not self.elastic_training:
            if given:
                found.append(Problem(given[0], "needs --elastic_training", "add --elastic_training"))
            return found
        if self.runner is not None and self.runner not in ELASTIC_RUNNERS:
            found.append(Problem("--elastic_training", f"needs nodes that dsrun's agents start (runners "
                                 f"{', '.join(ELASTIC_RUNNERS)}), not the {self.runner} runner"))
        if self.no_local_rank:
            found.append(Problem("--no_local_rank", "is not supported with --elastic_training (as in DeepSpeed)",
                                 "read LOCAL_RANK from the environment instead of dropping the argument"))
        low, high = self.min_elastic_nodes, self.max_elastic_nodes
        for flag, value in (("--min_elastic_nodes", low), ("--max_elastic_nodes", high)):
            if value not in (None, -1) and value < 1:
                found.append(Problem(flag, f"must be at least 1 (or -1 for the default), got {value}"))
        if low not in (None, -1) and high not in (None, -1) and 1 <= high < low:
            found.append(Problem("--max_elastic_nodes", f"is {high}, below --min_elastic_nodes {low}"))
        if self.rdzv_last_call_timeout < 1:  # torch's rendezvous counts whole seconds and refuses 0
            found.append(Problem("--rdzv_last_call_timeout", f"must be at least 1 second, got "
                                 f"{self.rdzv_last_call_timeout}", "use 1 for the shortest wait for more nodes"))
        if self.rdzv_keep_alive_interval is not None and self.rdzv_keep_alive_interval < 1:  # whole seconds
            found.append(Problem("--rdzv_keep_alive_interval", f"must be a whole number of seconds, at least 1, got "
                                 f"{self.rdzv_keep_alive_interval}", "use 1 for the quickest notice of a lost node"))
        return found

    def keep_alive_interval(self) -> int:
        """Seconds between an elastic node's rendezvous heartbeats: as given, else torch elastic's 5."""
        return self.rdzv_keep_alive_interval if self.rdzv_keep_alive_interval is not None \
            else DEFAULT_KEEP_ALIVE_INTERVAL

    def restarts(self) -> int:
        """Group restarts the agents allow: as given, else 0 (or DeepSpeed's 100 for elastic training)."""
        if self.max_restarts is not None:
            return self.max_restarts
        return ELASTIC_MAX_RESTARTS if self.elastic_training else 0

    def elastic_range(self, planned_nodes: int) -> tuple[int, int]:
        """``(min, max)`` nodes of an elastic job: 1 and the nodes planned unless given (DeepSpeed's defaults)."""
        low = self.min_elastic_nodes if self.min_elastic_nodes not in (None, -1) else 1
        high = self.max_elastic_nodes if self.max_elastic_nodes not in (None, -1) else max(planned_nodes, low)
        return low, high

    def validate(self) -> "LaunchOptions":
        found = self.problems()
        if found:
            raise UserError(found)
        return self


def _given(value: int | None) -> bool:
    return value is not None and value != -1


def options_from_mapping(mapping: Mapping[str, Any] | None, target: str, target_args: Sequence[str] = (),
                         *, module: bool = False, path: str = "launcher", **extra: object) -> LaunchOptions:
    """Build :class:`LaunchOptions` from a RunSpec ``launcher:`` mapping (see the module docstring).

    ``target``/``target_args``/``module`` say what each rank runs (``dsrun train`` passes the worker
    module); ``extra`` sets any other :class:`LaunchOptions` field (``cwd``, ``no_local_rank``...).
    Unknown keys and values of the wrong type are reported with their key path, e.g. ``launcher.num_procs``.
    """
    mapping = dict(mapping or {})
    problems: list[Problem] = []
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if key not in MAPPING_KEYS:
            problems.append(Problem(f"{path}.{key}", "is not a launcher key",
                                    did_you_mean(key, MAPPING_KEYS) or f"known keys: {', '.join(MAPPING_KEYS)}"))
            continue
        if value is None:
            continue
        attribute, types = MAPPING_KEYS[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            problems.append(Problem(f"{path}.{key}", f"must be {expected}, got {show(value)}"))
            continue
        values[attribute] = value
    known = {f.name for f in fields(LaunchOptions)}
    unknown = set(extra) - known
    if unknown:
        raise TypeError(f"unknown LaunchOptions fields: {sorted(unknown)}")
    options = LaunchOptions(target=target, target_args=list(target_args), module=module, **{**values, **extra})
    # report the mapping's own problems together with the option checks, all under their key paths
    # (named by RunSpec keys rather than the CLI flags the option checks use)
    problems = problems + [Problem(key_path(p.path, path), p.message, p.hint) for p in options.problems()]
    if problems:
        raise UserError(problems)
    return options


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """:class:`LaunchOptions` from parsed ``dsrun launch`` flags (the namespace that
    :func:`dsrun.cli.launch.add_arguments` describes)."""
    runner = args.runner
    if args.no_ssh:
        runner = "no_ssh"
    return LaunchOptions(
        target=args.script, target_args=list(args.script_args), runner=runner, num_procs=args.num_procs,
        num_nodes=args.num_nodes, hostfile=args.hostfile, include=args.include, exclude=args.exclude,
        master_addr=args.master_addr, master_port=args.master_port, node_rank=args.node_rank,
        ssh_port=args.ssh_port, launcher_args=args.launcher_args, no_ssh_check=args.no_ssh_check,
        module=args.module, no_python=args.no_python, no_local_rank=args.no_local_rank,
        bind_cores_to_rank=args.bind_cores_to_rank, bind_core_list=args.bind_core_list, log_dir=args.log_dir,
        save_pid=args.save_pid, max_restarts=args.max_restarts, force_multi=args.force_multi,
        elastic_training=args.elastic_training, min_elastic_nodes=args.min_elastic_nodes,
        max_elastic_nodes=args.max_elastic_nodes, rdzv_last_call_timeout=args.rdzv_last_call_timeout,
        rdzv_keep_alive_interval=args.rdzv_keep_alive_interval,
        comment=args.comment, account=args.account)


def key_path(flags: str, path: str) -> str:
    """``--include/--exclude`` -> ``launcher.include/launcher.exclude``; ``--launcher`` -> ``launcher.runner``."""
    parts = []
    for flag in flags.split("/"):
        name = flag[2:] if flag.startswith("--") else flag
        parts.append(f"{path}.{'runner' if name == 'launcher' else name}" if flag.startswith("--") else flag)
    return "/".join(parts)
