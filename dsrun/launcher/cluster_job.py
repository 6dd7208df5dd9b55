"""A job for a cluster's own engine: what ``dsrun export-job`` writes a Kubernetes manifest or a batch script from.

The cluster starts the ranks (torchrun in every pod, ``srun`` one task per rank) and ``dsrun train`` becomes each
one (:mod:`dsrun.launcher.outer`, docs/torchrun.md). A :class:`ClusterJob` holds what every target needs: the
world (``nodes`` x ``procs_per_node``, from the recipe's ``launcher.num_nodes`` / ``num_procs``), the arguments
of ``dsrun train`` that compose the recipe again on the cluster (the user's overrides, then ``train.resume=auto``
so a restarted job resumes from the newest checkpoint of the same recipe and overrides), where the run
directories go, and the resources of one node. :mod:`dsrun.launcher.kubernetes` and :mod:`dsrun.launcher.sbatch`
turn it into text; nothing here talks to a cluster.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from dsrun.utils.errors import Problem

# what a restarted job adds to the user's overrides: the newest checkpoint of the same recipe and overrides
RESUME_OVERRIDE = "train.resume=auto"
# Hydra's own run directory below its outputs/ folder: train.resume=auto reads the runs two levels below one folder
RUN_DIR_PATTERN = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
# the static rendezvous of the Kubernetes targets: node 0 hosts torch's store (torchrun's default port); an sbatch
# script's ranks meet on a port the system gives rank 0 (dsrun.launcher.sbatch)
RENDEZVOUS_PORT = 29500
# torchrun's default signals plus SIGUSR1; the seconds each layer (torchrun, the pod, the batch shell) adds to the
# ranks' train.preemption.grace_s so that the one outside never cuts a save the one inside still allows
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SIGNAL_MARGIN_S = 10
# a Kubernetes object name that stays a DNS label in the names derived from it (JobSet's pod host names add
# "-node-0-0", the PyTorchJob's services "-worker-NN")
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 40


@dataclass(frozen=True)
class NodeResources:
    """What one node (a pod, a Slurm node) asks for: ``cpus`` (Kubernetes' quantity: ``8``, ``500m``; Slurm: per
    task), ``memory`` (``32Gi``; Slurm: ``32G``), ``gpus`` (one per rank when set)."""

    cpus: str | None = None
    memory: str | None = None
    gpus: int = 0


@dataclass(frozen=True)
class ClusterJob:
    """One training job as a cluster's engine runs it: ``nodes`` pods or Slurm nodes, each starting
    ``procs_per_node`` ranks of ``dsrun train TRAIN_ARGS``."""

    name: str
    nodes: int
    procs_per_node: int
    train_args: tuple[str, ...]         # after `dsrun train`: the overrides, then train.resume=auto
    runs_dir: str | None = None         # the folder of the run directories (outputs/DATE/TIME); None: Hydra's
    resources: NodeResources = field(default_factory=NodeResources)
    max_restarts: int = 3               # restarts of the whole job before it counts as failed
    grace_period_s: int = 140           # from SIGTERM to SIGKILL: the ranks stop at a step boundary and save
    rank_grace_s: int = 120             # the ranks' own train.preemption.grace_s, rounded up
    # Kubernetes only
    image: str | None = None
    namespace: str | None = None
    pvc: str | None = None              # the PersistentVolumeClaim holding the run directories
    # Slurm only
    time: str | None = None
    partition: str | None = None
    master_port: int | None = None      # the recipe's launcher.master_port; None: one the system gives rank 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def torchrun_argv(self) -> list[str]:
        """The command of every pod: torchrun starts this node's ranks, each of which becomes that rank of
        ``dsrun train``. The node's index and node 0's address come from the job kind's ``PET_*`` variables
        (torchrun reads ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` as its flags' defaults)."""
        return ["torchrun", "--nnodes", str(self.nodes), "--nproc-per-node", str(self.procs_per_node),
                # SIGUSR1 passed on too (a preemption notice; torchrun would die of it), and the ranks given their
                # grace period to save before torchrun kills them (its default waits 30 s)
                "--signals-to-handle", TORCHRUN_SIGNALS, "--shutdown-timeout", str(self.rank_grace_s + SIGNAL_MARGIN_S),
                "-m", "dsrun", "train", *self.train_args]

    def mlflow_store(self) -> str | None:
        """The local MLflow store beside the run directories (``RUNS_DIR/mlruns``, as ``dsrun train`` keeps one
        beside Hydra's ``outputs/``), as ``MLFLOW_TRACKING_URI``; a recipe's ``mlflow.tracking_uri`` wins over it.
        None without ``runs_dir``: the working directory's ``mlruns/``, as always."""
        return f"sqlite:///{self.runs_dir.rstrip('/')}/mlruns/mlflow.db" if self.runs_dir else None

    def rank_argv(self) -> list[str]:
        """One rank's command under ``srun`` (one task per rank): ``dsrun train`` becomes that task's rank."""
        return ["python", "-m", "dsrun", "train", *self.train_args]


def train_args(overrides: list[str], recipes_dirs: list[str], runs_dir: str | None) -> tuple[str, ...]:
    """``dsrun train``'s arguments on the cluster: the recipe folders (paths the image or the nodes have), the
    user's overrides, each run's directory under ``runs_dir`` (time-stamped as Hydra's default, so a restarted
    job's run sits beside the earlier ones, where ``train.resume=auto`` looks), and :data:`RESUME_OVERRIDE`."""
    folders = [arg for folder in recipes_dirs for arg in ("--recipes-dir", folder)]
    run_dir = [f"hydra.run.dir={runs_dir.rstrip('/')}/{RUN_DIR_PATTERN}"] if runs_dir else []
    return (*folders, *overrides, *run_dir, RESUME_OVERRIDE)


def name_problems(name: str) -> list[Problem]:
    """Why ``name`` cannot name the job's objects (empty when it can)."""
    if len(name) <= MAX_NAME and _NAME.fullmatch(name):
        return []
    return [Problem("--name", f"{name!r} is not a name the job's objects can take: lower-case letters, digits and "
                    f"'-', starting with a letter, ending with a letter or digit, at most {MAX_NAME} characters",
                    "e.g. --name gpt-zero3")]


def default_name(overrides: list[str]) -> str:
    """``dsrun-<recipe>`` (``+recipe=gpt_zero3`` -> ``dsrun-gpt-zero3``), or ``dsrun-train``."""
    recipe = next((o.split("=", 1)[1] for o in reversed(overrides) if o.lstrip("+").startswith("recipe=")), "train")
    name = re.sub(r"[^a-z0-9-]+", "-", f"dsrun-{recipe.lower()}").strip("-")
    return name[:MAX_NAME].rstrip("-")
