"""Ranks an outer launcher made: ``dsrun train`` (and ``dsrun launch``) started by torchrun, srun or mpirun.

When the process already is one rank of a job that another launcher started, dsrun starts no ranks: it becomes
that rank (docs/torchrun.md). :func:`detect_outer_launcher` reads the launcher's variables:

* torch elastic (``torchrun``, Kubeflow's PyTorchJob, any ``LocalElasticAgent``): ``TORCHELASTIC_RUN_ID`` with
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``;
* Slurm's ``srun``, only for a task of a job step (``SLURM_STEP_ID`` a step number, not the batch script's or
  the allocation's own step): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_STEP_NODELIST``;
* Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
  ``OMPI_COMM_WORLD_LOCAL_SIZE`` (ranks placed by slot, Open MPI's default).

torch elastic's variables win over the others (torchrun started by srun or mpirun, one per node, is the usual
way), then Open MPI's, then Slurm's. Slurm and Open MPI name no rendezvous: ``MASTER_ADDR``/``MASTER_PORT`` when
set, else Slurm's first node of the step (one node: 127.0.0.1) and port 29500. The ``srun`` tasks of a job dsrun
submitted (``hydra/launcher=submitit_slurm``, ``dsrun export-job --target sbatch``) meet on no fixed port: rank 0's
store takes one the system gives it (:data:`SYSTEM_PORT`) and tells the others through the run directory
(:mod:`dsrun.launcher.slurm_jobs`).

:func:`launcher_conflicts` compares a RunSpec's ``launcher:`` mapping with the outer launcher's world: a key
that asks for something the outer launcher decided otherwise (``num_procs`` against the ranks per node,
``num_nodes``, ``node_rank``, a rendezvous address) or that only dsrun's own launcher can do (a hostfile, ssh,
restarts, core binding, per-rank logs) is one problem naming the key, the outer launcher's value and a fix;
keys that agree are accepted. :func:`outer_plan` is the :class:`~dsrun.launcher.plan.LaunchPlan` of such a run:
the outer world, no commands. ``dsrun export-job`` makes the same checks before it writes a job for a cluster
(docs/kubernetes.md), with an ``OuterRank(planned=True)``: rank 0 of that job, its messages worded for the job.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from dsrun.launcher.options import DEFAULT_MASTER_PORT, LaunchOptions
from dsrun.launcher.plan import LaunchPlan
from dsrun.utils.errors import Problem, show

# Slurm's special steps (batch script, extern, interactive) have ids near 2**32; a task of `srun` has a small one
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# the runner of dsrun's own that starts ranks the way each outer launcher does: naming it agrees
_MATCHING_RUNNER = {"torchrun": "no_ssh", "srun": "slurm", "mpirun": "openmpi"}
# an OuterRank's master_port when the ranks meet on a port the system gives rank 0's store as it binds (told to the
# others through the run directory's .slurm_rendezvous/: dsrun.launcher.slurm_jobs), not on one named beforehand
SYSTEM_PORT = 0


@dataclass(frozen=True)
class OuterRank:
    """This process's place in a job an outer launcher (``torchrun``, ``srun``, ``mpirun``) started."""

    launcher: str             # "torchrun" | "srun" | "mpirun"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int     # ranks on this node
    node_rank: int
    num_nodes: int
    master_addr: str | None   # None: the launcher named none and the job spans nodes
    master_port: int          # SYSTEM_PORT: rank 0's store takes the port the system gives it
    names: Mapping[str, str]  # quantity -> the variable it was read from, for messages ("world_size": "WORLD_SIZE")
    node_sizes: tuple[int, ...] = ()  # ranks on each node when the launcher says (srun); else every node's the same
    planned: bool = False     # rank 0 of a job being written (dsrun export-job), not this process: messages say so

    def variable(self, quantity: str) -> str:
        """``NAME=VALUE`` of the variable ``quantity`` came from (``LOCAL_WORLD_SIZE=2``)."""
        return f"{self.names.get(quantity, quantity)}={getattr(self, quantity)}"

    def describe(self) -> str:
        """Where the world size came from, for the batch-size explanation."""
        return (f"{self.launcher}: {self.variable('world_size')} ({self.local_world_size} per node on "
                f"{self.num_nodes} node(s))")

    def environment(self) -> dict[str, str]:
        """What a rank of dsrun's own launcher has in its environment (``RANK`` ... ``CROSS_SIZE``), from the outer
        launcher's variables; ``torch.distributed``'s ``env://`` rendezvous reads them."""
        env = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
               "LOCAL_WORLD_SIZE": self.local_world_size, "LOCAL_SIZE": self.local_world_size,
               "CROSS_RANK": self.node_rank, "CROSS_SIZE": self.num_nodes, "MASTER_PORT": self.master_port}
        if self.master_addr:
            env["MASTER_ADDR"] = self.master_addr
        return {name: str(value) for name, value in env.items()}

    def hosts(self) -> dict[str, list[int]]:
        """The job's nodes as a plan lists them, each with the slots its ranks take (the last node takes what is
        left of an uneven world): this node is ``localhost`` (the checks before launch look at this machine's
        files and memory only for a plan wholly on it), the others ``node<i>`` (the outer launcher knows their
        names)."""
        if len(self.node_sizes) == self.num_nodes:
            sizes = list(self.node_sizes)
        else:
            sizes = [min(self.local_world_size, self.world_size - node * self.local_world_size)
                     for node in range(self.num_nodes)]
        return {("localhost" if node == self.node_rank else f"node{node}"): list(range(size))
                for node, size in enumerate(sizes)}


def _digits(environ: Mapping[str, str], *names: str) -> bool:
    return all(environ.get(name, "").isdigit() for name in names)


def _torch_elastic(environ: Mapping[str, str]) -> OuterRank | None:
    if not environ.get("TORCHELASTIC_RUN_ID") or not _digits(environ, "RANK", "WORLD_SIZE"):
        return None
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    local_size = int(environ["LOCAL_WORLD_SIZE"]) if _digits(environ, "LOCAL_WORLD_SIZE") else world
    local = int(environ["LOCAL_RANK"]) if _digits(environ, "LOCAL_RANK") else rank % local_size
    node = int(environ["GROUP_RANK"]) if _digits(environ, "GROUP_RANK") else rank // local_size
    nodes = int(environ["GROUP_WORLD_SIZE"]) if _digits(environ, "GROUP_WORLD_SIZE") else -(-world // local_size)
    port = int(environ["MASTER_PORT"]) if _digits(environ, "MASTER_PORT") else DEFAULT_MASTER_PORT
    return OuterRank("torchrun", rank, world, local, local_size, node, nodes, environ.get("MASTER_ADDR") or None,
                     port, {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                            "local_world_size": "LOCAL_WORLD_SIZE", "node_rank": "GROUP_RANK",
                            "num_nodes": "GROUP_WORLD_SIZE", "master_addr": "MASTER_ADDR",
                            "master_port": "MASTER_PORT"})


def _open_mpi(environ: Mapping[str, str]) -> OuterRank | None:
    if not _digits(environ, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        return None
    rank, world = int(environ["OMPI_COMM_WORLD_RANK"]), int(environ["OMPI_COMM_WORLD_SIZE"])
    local_size = (int(environ["OMPI_COMM_WORLD_LOCAL_SIZE"]) if _digits(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
                  else world)
    local = int(environ["OMPI_COMM_WORLD_LOCAL_RANK"]) if _digits(environ, "OMPI_COMM_WORLD_LOCAL_RANK") else 0
    nodes = -(-world // local_size)
    addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if nodes == 1 else None)
    port = int(environ["MASTER_PORT"]) if _digits(environ, "MASTER_PORT") else DEFAULT_MASTER_PORT
    return OuterRank("mpirun", rank, world, local, local_size, rank // local_size, nodes, addr, port,
                     {"rank": "OMPI_COMM_WORLD_RANK", "world_size": "OMPI_COMM_WORLD_SIZE",
                      "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK", "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
                      "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"})


def slurm_tasks_per_node(text: str) -> list[int]:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node (``[2, 2, 2, 1]``)."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_first_host(nodelist: str) -> str | None:
    """The first host of a Slurm host list (``node[03-05,9],gpu1`` -> ``node03``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return None
    prefix, ranges = match.group(1), match.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def _slurm(environ: Mapping[str, str]) -> OuterRank | None:
    if not _digits(environ, "SLURM_STEP_ID", "SLURM_PROCID") or int(environ["SLURM_STEP_ID"]) >= _SLURM_SPECIAL_STEPS:
        return None
    world_name = "SLURM_STEP_NUM_TASKS" if _digits(environ, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if not _digits(environ, world_name):
        return None
    rank, world = int(environ["SLURM_PROCID"]), int(environ[world_name])
    node = int(environ["SLURM_NODEID"]) if _digits(environ, "SLURM_NODEID") else 0
    per_node = slurm_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    local_size = per_node[node] if node < len(per_node) else world
    nodes_name = "SLURM_STEP_NUM_NODES" if _digits(environ, "SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    nodes = int(environ[nodes_name]) if _digits(environ, nodes_name) else max(1, len(per_node))
    local = int(environ["SLURM_LOCALID"]) if _digits(environ, "SLURM_LOCALID") else 0
    addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if nodes == 1 else
                                          slurm_first_host(environ.get("SLURM_STEP_NODELIST", "")))
    port = int(environ["MASTER_PORT"]) if _digits(environ, "MASTER_PORT") else DEFAULT_MASTER_PORT
    return OuterRank("srun", rank, world, local, local_size, node, nodes, addr, port,
                     {"rank": "SLURM_PROCID", "world_size": world_name, "local_rank": "SLURM_LOCALID",
                      "local_world_size": "SLURM_STEP_TASKS_PER_NODE", "node_rank": "SLURM_NODEID",
                      "num_nodes": nodes_name, "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"},
                     tuple(per_node))


def detect_outer_launcher(environ: Mapping[str, str] | None = None) -> OuterRank | None:
    """This process's rank in a job torchrun, srun or mpirun started; None when no outer launcher made it a rank."""
    environ = os.environ if environ is None else environ
    for detect in (_torch_elastic, _open_mpi, _slurm):
        found = detect(environ)
        if found is not None:
            return found
    return None


# keys only dsrun's own launcher acts on: refused when set, with where the outer launcher takes the same wish
_OWN_LAUNCHER_KEYS: dict[str, str] = {
    "hostfile": "the outer launcher chose the nodes; set launcher.hostfile=null",
    "include": "the outer launcher chose the nodes and slots; set launcher.include=null",
    "exclude": "the outer launcher chose the nodes and slots; set launcher.exclude=null",
    "ssh_port": "no ssh is used under an outer launcher; set launcher.ssh_port=null",
    "launcher_args": "give those options to the outer launcher itself",
    "bind_cores_to_rank": "bind cores with the outer launcher (srun --cpu-bind, mpirun --bind-to core, numactl)",
    "bind_core_list": "bind cores with the outer launcher (srun --cpu-bind, mpirun --bind-to core, numactl)",
    "log_dir": "per-rank logs are the outer launcher's (torchrun --log-dir, srun --output); set launcher.log_dir=null",
    "force_multi": "set launcher.force_multi=false",
    "elastic_training": "elasticity is the outer launcher's (torchrun --nnodes MIN:MAX)",
    "min_elastic_nodes": "elasticity is the outer launcher's (torchrun --nnodes MIN:MAX)",
    "max_elastic_nodes": "elasticity is the outer launcher's (torchrun --nnodes MIN:MAX)",
    "rdzv_keep_alive_interval": "the rendezvous is the outer launcher's (torchrun --rdzv-conf keep_alive_interval=S)",
    "max_restarts": "restarts are the outer launcher's (torchrun --max-restarts)",
    "comment": "give it to srun/sbatch itself (--comment)",
    "account": "give it to srun/sbatch itself (--account)",
}


def _set(value: Any) -> bool:
    """Whether a launcher key asks for something (null, false, 0, "" and -1 ask for nothing)."""
    return value not in (None, False, 0, "", -1)


def launcher_conflicts(mapping: Mapping[str, Any] | None, outer: OuterRank, path: str = "launcher") -> list[Problem]:
    """The keys of a RunSpec's ``launcher:`` mapping that conflict with the outer launcher's world, one problem
    each (the key, the outer launcher's value, a fix); empty when every key agrees. ``path`` names the keys
    (``launcher.num_procs``); ``"--"`` names them as ``dsrun launch``'s flags (``--num_procs``)."""
    mapping = dict(mapping or {})
    problems: list[Problem] = []
    by = outer.launcher

    def name(key: str) -> str:
        return f"{path}.{key}" if path != "--" else ("--launcher" if key == "runner" else f"--{key}")

    def refuse(key: str, message: str, hint: str) -> None:
        hint = hint.replace(f"{path}.{key}=", f"{name(key)} ") if path == "--" else hint
        problems.append(Problem(name(key), message, hint))

    started, already = ((f"{by} starts every rank of the job",) * 2 if outer.planned
                        else (f"{by} started this rank", f"{by} already started this rank"))
    runner = mapping.get("runner")
    if runner not in (None, "local", _MATCHING_RUNNER[by]):
        refuse("runner", f"is {show(runner)}, but {already}",
               f"drop {name('runner')}: under {by}, dsrun starts no ranks")
    expected = {"num_procs": ("local_world_size", "rank(s) per node"), "num_nodes": ("num_nodes", "node(s)"),
                "node_rank": ("node_rank", "as this node's index")}
    for key, (quantity, what) in expected.items():
        value = mapping.get(key)
        if value is not None and value != -1 and value != getattr(outer, quantity):
            refuse(key, f"is {show(value)}, but {by} started {getattr(outer, quantity)} {what} "
                   f"({outer.variable(quantity)})", f"set {path}.{key}={getattr(outer, quantity)} or change "
                   f"the {by} command")
    addr = mapping.get("master_addr")
    # the local runner's loopback default names this machine, not a rendezvous the outer launcher set up
    if addr and addr != outer.master_addr and not (runner in (None, "local") and addr in _LOOPBACK):
        refuse("master_addr", f"is {show(addr)}, but {by} meets at {outer.master_addr} "
               f"({outer.variable('master_addr')})", f"drop {name('master_addr')}: the outer launcher's rendezvous is used")
    port = mapping.get("master_port")
    if port is not None and outer.master_port == SYSTEM_PORT:
        refuse("master_port", f"is {show(port)}, but the {by} tasks of this job meet on a port the system gives rank "
               "0's store as it binds (told to the other ranks through the run directory's .slurm_rendezvous/), so "
               "that no other job on the node holds it", f"drop {name('master_port')}: dsrun picks the port itself")
    elif port is not None and port != outer.master_port:
        refuse("master_port", f"is {show(port)}, but {by} meets at port {outer.master_port} "
               f"({outer.variable('master_port')})", f"drop {name('master_port')}: the outer launcher's rendezvous is used")
    for key, hint in _OWN_LAUNCHER_KEYS.items():
        if _set(mapping.get(key)):
            refuse(key, f"is {show(mapping[key])}, which only dsrun's own launcher acts on, but {started}",
                   hint if path != "--" else hint.replace(f"set launcher.{key}=null", f"drop {name(key)}"))
    if outer.master_addr is None:
        problems.append(Problem("MASTER_ADDR", f"is not set and the {by} job spans {outer.num_nodes} nodes",
                                "export MASTER_ADDR (node 0's address) and MASTER_PORT to every rank"))
    return problems


def outer_plan(options: LaunchOptions, outer: OuterRank) -> LaunchPlan:
    """The plan of a run whose ranks the outer launcher started: its world, its rendezvous, no commands."""
    return LaunchPlan(hosts=outer.hosts(), world_size=outer.world_size, master_addr=outer.master_addr or "",
                      master_port=outer.master_port, runner=by_outer(outer), commands=[], env={}, options=options,
                      outer=outer.describe())


def by_outer(outer: OuterRank) -> str:
    """The plan's runner name for a run an outer launcher started (``outer:torchrun``)."""
    return f"outer:{outer.launcher}"


def rank_argv(options: LaunchOptions, outer: OuterRank) -> list[str]:
    """What ``dsrun launch`` runs as the outer launcher's rank, in place of itself: the script as dsrun's agent
    starts it (``python [-m] SCRIPT ARGS --local_rank=N``)."""
    if options.no_python:
        argv = [options.target]
    else:
        argv = [options.python, *(["-m"] if options.module else []), options.target]
    argv += options.target_args
    return argv if options.no_local_rank else [*argv, f"--local_rank={outer.local_rank}"]


def launch_conflicts(options: LaunchOptions, outer: OuterRank) -> list[Problem]:
    """``dsrun launch``'s flags that conflict with the outer launcher's world (:func:`launcher_conflicts`)."""
    keys = ("runner", "num_procs", "num_nodes", "node_rank", "master_addr", "master_port", *_OWN_LAUNCHER_KEYS)
    return launcher_conflicts({key: getattr(options, key) for key in keys}, outer, path="--")
