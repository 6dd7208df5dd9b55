"""Write a Kubernetes manifest or a Slurm batch script that trains a recipe on a cluster, no ssh anywhere.

Examples:
  dsrun export-job --target pytorchjob --image registry/dsrun:1 --pvc dsrun-runs +recipe=gpt_zero3 \\
      launcher.num_nodes=2 launcher.num_procs=4 train.save_interval=100 | kubectl apply -f -
  dsrun export-job --target trainjob --image registry/dsrun:1 --pvc dsrun-runs -o job.yaml +recipe=gpt_zero3
  dsrun export-job --target jobset --image registry/dsrun:1 --pvc dsrun-runs --gpus 8 launcher.num_procs=8
  dsrun export-job --target sbatch --runs-dir /shared/runs --time 04:00:00 +recipe=gpt_zero3 > job.sh; sbatch job.sh

The recipe is composed and checked here as each rank will (batch sizes for the job's world, launcher keys
that conflict with torchrun/srun refused). Replicas come from launcher.num_nodes (pods or Slurm nodes) and
launcher.num_procs (ranks per node). Every pod runs
  torchrun --nnodes N --nproc-per-node P -m dsrun train OVERRIDES hydra.run.dir=/runs/outputs/... train.resume=auto
(sbatch: srun, one task per rank, each `python -m dsrun train ...`), so each rank becomes that rank of dsrun
train (docs/torchrun.md), the run directories land on the volume, and a restarted job resumes from the newest
checkpoint of the same recipe and overrides. docs/kubernetes.md.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dsrun.cli.common import add_compose_arguments
from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from dsrun.launcher.cluster_job import ClusterJob
    from dsrun.launcher.outer import OuterRank
    from dsrun.runspec import ResolvedRun

TARGETS = ("pytorchjob", "trainjob", "jobset", "sbatch")
# options only some targets read (any other target refuses them)
_READ_BY = {"image": "pytorchjob/trainjob/jobset", "namespace": "pytorchjob/trainjob/jobset",
            "pvc": "pytorchjob/trainjob/jobset", "grace_period": "pytorchjob/trainjob/jobset",
            "max_restarts": "pytorchjob/jobset", "time": "sbatch", "partition": "sbatch"}
DEFAULT_MAX_RESTARTS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--target", required=True, metavar="KIND",
                        help="pytorchjob (Kubeflow training operator, kubeflow.org/v1), trainjob (Kubeflow Trainer, "
                             "trainer.kubeflow.org/v1alpha1, runtime torch-distributed), jobset "
                             "(jobset.x-k8s.io/v1alpha2) or sbatch (a Slurm batch script)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None, help="write to FILE instead of stdout")
    parser.add_argument("--name", default=None,
                        help="the job's name (default dsrun-<recipe>): lower-case letters, digits, '-'")
    parser.add_argument("--image", default=None, help="Kubernetes: the container image, with dsrun installed")
    parser.add_argument("--namespace", default=None, help="Kubernetes: the namespace (default: kubectl's current one)")
    parser.add_argument("--pvc", default=None, metavar="CLAIM",
                        help="Kubernetes: the PersistentVolumeClaim mounted at /runs in every pod for the run "
                             "directories and checkpoints (ReadWriteMany for several nodes); without it, an emptyDir "
                             "lost with the pod")
    parser.add_argument("--runs-dir", default=None, metavar="DIR",
                        help="the folder of the run directories (outputs/DATE/TIME below it): Kubernetes /runs (the "
                             "volume); sbatch: default the submission folder's outputs/, give a folder every node sees")
    parser.add_argument("--gpus", type=int, default=0, metavar="N",
                        help="GPUs per node (one per rank: N equals launcher.num_procs); default none (CPU ranks)")
    parser.add_argument("--cpus", default=None, metavar="Q",
                        help="Kubernetes: CPUs per pod (a quantity, default one per rank); sbatch: --cpus-per-task")
    parser.add_argument("--memory", default=None, metavar="Q",
                        help="memory per pod (Kubernetes quantity, 64Gi) or per node (sbatch --mem, 64G)")
    parser.add_argument("--max-restarts", type=int, default=None, metavar="N",
                        help="PyTorchJob, JobSet: restarts of the job before it counts as failed (backoffLimit, "
                             "failurePolicy.maxRestarts; default 3); a TrainJob's are its runtime's")
    parser.add_argument("--grace-period", type=int, default=None, metavar="S",
                        help="Kubernetes: seconds from SIGTERM to SIGKILL (terminationGracePeriodSeconds), for the "
                             "ranks to reach a step boundary and save; at least train.preemption.grace_s + 20 "
                             "(the default: 140 with the default 120)")
    parser.add_argument("--time", default=None, help="sbatch: the time limit (--time, e.g. 04:00:00)")
    parser.add_argument("--partition", default=None, help="sbatch: the partition")
    add_compose_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from dsrun.launcher.cluster_job import (SIGNAL_MARGIN_S, ClusterJob, NodeResources, default_name, name_problems,
                                            train_args)
    from dsrun.launcher.kubernetes import RUNS_MOUNT

    target = _target(args.target)
    kubernetes = target != "sbatch"
    problems = _option_problems(args, kubernetes)
    name = args.name or default_name(args.overrides)
    problems += name_problems(name)
    if problems:
        raise UserError(problems)
    resolved, nodes, procs = _check_recipe(args, target, name)
    if args.gpus and args.gpus != procs:
        problems.append(Problem("--gpus", f"is {args.gpus}, but the recipe starts {procs} rank(s) per node "
                                "(launcher.num_procs) and each rank takes one GPU",
                                f"give --gpus {procs}, or launcher.num_procs={args.gpus}"))
    if kubernetes and nodes > 1 and not args.pvc:
        problems.append(Problem("--pvc", f"is missing, but the job spans {nodes} pods and the ranks of every pod "
                                "read rank 0's run directory", "give a ReadWriteMany PersistentVolumeClaim"))
    if problems:
        raise UserError(problems)
    rank_grace = math.ceil(resolved.train.preemption.grace_s)
    if args.grace_period is not None and args.grace_period < rank_grace + 2 * SIGNAL_MARGIN_S:
        raise UserError(Problem("--grace-period", f"is {args.grace_period} s, but the ranks may take "
                                f"train.preemption.grace_s={resolved.train.preemption.grace_s:g} s to save and torchrun "
                                f"waits {SIGNAL_MARGIN_S} s more", f"give at least {rank_grace + 2 * SIGNAL_MARGIN_S}, or "
                                "lower train.preemption.grace_s"))
    _notes(resolved, kubernetes and not args.pvc)
    runs_dir = RUNS_MOUNT if kubernetes else args.runs_dir
    job = ClusterJob(name=name, nodes=nodes, procs_per_node=procs,
                     # sbatch: the batch shell fixes each run's directory (the tasks meet in it: dsrun.launcher.sbatch)
                     train_args=train_args(args.overrides, args.recipes_dir, runs_dir if kubernetes else None),
                     runs_dir=runs_dir,
                     resources=NodeResources(args.cpus, args.memory, args.gpus),
                     max_restarts=_given(args.max_restarts, DEFAULT_MAX_RESTARTS),
                     grace_period_s=_given(args.grace_period, rank_grace + 2 * SIGNAL_MARGIN_S), rank_grace_s=rank_grace,
                     image=args.image, namespace=args.namespace, pvc=args.pvc, time=args.time, partition=args.partition,
                     master_port=resolved.runspec.launcher.get("master_port") if target == "sbatch" else None)
    _write(args.output, _render(target, job), target)
    return 0


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def _target(text: str) -> str:
    if text in TARGETS:
        return text
    from dsrun.utils.suggest import did_you_mean

    raise UserError(Problem("--target", f"unknown target {text!r}; expected one of {', '.join(TARGETS)}",
                            did_you_mean(text, TARGETS)))


def _option_problems(args: argparse.Namespace, kubernetes: bool) -> list[Problem]:
    """Options the target does not read (none is silently ignored), the image a pod needs, the overrides that
    would defeat resuming on restart."""
    from dsrun.cli.resume import override_key

    problems: list[Problem] = []
    target = args.target
    for option, targets in _READ_BY.items():
        if getattr(args, option) is not None and target not in targets.split("/"):
            flag = "--" + option.replace("_", "-")
            problems.append(Problem(flag, f"is not read by --target {target}",
                                    f"drop it; it is for --target {targets}"))
    if kubernetes and args.runs_dir is not None:
        problems.append(Problem("--runs-dir", f"is /runs in every pod of --target {target} (the volume's mount)",
                                "drop it; --pvc names the volume"))
    elif args.runs_dir is not None and not args.runs_dir.startswith("/"):
        problems.append(Problem("--runs-dir", f"is {args.runs_dir!r}, a relative path", "give the absolute path of a "
                                "folder every node sees at the same path"))
    if args.grace_period is not None and args.grace_period < 1:
        problems.append(Problem("--grace-period", f"is {args.grace_period}", "give the seconds a rank needs to save"))
    if kubernetes and not args.image:
        problems.append(Problem("--image", f"is missing; every pod of --target {target} runs it",
                                "give an image with dsrun installed, e.g. --image registry/dsrun:1"))
    if args.max_restarts is not None and args.max_restarts < 0:
        problems.append(Problem("--max-restarts", f"is {args.max_restarts}", "give 0 or more"))
    if args.gpus < 0:
        problems.append(Problem("--gpus", f"is {args.gpus}", "give 0 or more"))
    for override in args.overrides:
        key, value = override_key(override), override.split("=", 1)[-1]
        if key == "train.resume" and value != "auto":
            problems.append(Problem("train.resume", f"is {value}, but the exported job resumes a restarted run "
                                    "with train.resume=auto", "drop it (auto starts at step 0 the first time)"))
        if key == "hydra.run.dir":
            problems.append(Problem("hydra.run.dir", "is set, but each run of the exported job gets a directory of "
                                    "its own beside the earlier ones, where train.resume=auto looks",
                                    "drop it" + ("; --runs-dir names their folder" if not kubernetes else "")))
    return problems


def _check_recipe(args: argparse.Namespace, target: str, name: str) -> tuple[ResolvedRun, int, int]:
    """Compose the recipe and resolve it as every rank of the job will (the world, batch sizes, launcher keys
    that conflict with torchrun or srun); return it with its nodes and ranks per node."""
    from omegaconf import OmegaConf

    from dsrun.compose import compose_runspec
    from dsrun.config import announce
    from dsrun.runspec import resolve_run

    cfg = compose_runspec(args.overrides, args.recipes_dir)
    launcher = OmegaConf.to_container(cfg.launcher, resolve=True) if "launcher" in cfg else {}
    nodes, procs = (_count(launcher, "num_nodes"), _count(launcher, "num_procs"))
    if launcher.get("node_rank") not in (None, -1):  # every node of the job has its own: the kind gives it
        raise UserError(Problem("launcher.node_rank", f"is {launcher['node_rank']}, but each node of the exported job "
                                "takes its own index from the cluster", "set launcher.node_rank=null"))
    resolved = resolve_run(cfg, outer=_job_world(target, name, nodes, procs, launcher.get("master_port")))
    announce(resolved.ds)
    return resolved, nodes, procs


def _notes(resolved: ResolvedRun, no_volume: bool) -> None:
    """What a restart will not find, said on stderr (the manifest is stdout)."""
    if not resolved.train.save_interval:
        print("note: train.save_interval is 0: the job saves only when it is stopped (SIGTERM, SIGUSR1), so a job "
              "restarted after a crash starts again at step 0 (set train.save_interval=N)", file=sys.stderr)
    if no_volume:
        print("note: no --pvc: the run directories live in an emptyDir, lost when the pod is deleted (a preempted "
              "pod's job starts again at step 0)", file=sys.stderr)


def _count(launcher: dict, key: str) -> int:
    value = launcher.get(key)
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(Problem(f"launcher.{key}", f"is {value!r}", "give a whole number of 1 or more"))
    return value


def _job_world(target: str, name: str, nodes: int, procs: int, master_port: int | None) -> OuterRank:
    """Rank 0 of the exported job as :mod:`dsrun.launcher.outer` will see it: the names in its messages are the
    job's own (``--nproc-per-node``, ``--ntasks-per-node``)."""
    from dsrun.launcher.kubernetes import MASTER_PORTS
    from dsrun.launcher.outer import SYSTEM_PORT, OuterRank

    if target == "sbatch":  # the script exports the recipe's port when it names one, else rank 0's store is given one
        port = master_port or SYSTEM_PORT
        return OuterRank("srun", 0, nodes * procs, 0, procs, 0, nodes, "the step's first node", port,
                         {"local_world_size": "--ntasks-per-node", "num_nodes": "--nodes", "node_rank": "SLURM_NODEID",
                          "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}, planned=True)
    master = f"{name}-master-0" if target == "pytorchjob" else f"{name}-node-0-0.{name}"
    return OuterRank("torchrun", 0, nodes * procs, 0, procs, 0, nodes, master, MASTER_PORTS[target],
                     {"local_world_size": "--nproc-per-node", "num_nodes": "--nnodes", "node_rank": "PET_NODE_RANK",
                      "master_addr": "PET_MASTER_ADDR", "master_port": "PET_MASTER_PORT"}, planned=True)


def _render(target: str, job: ClusterJob) -> str:
    if target == "sbatch":
        from dsrun.launcher.sbatch import batch_script

        return batch_script(job)
    import yaml

    from dsrun.launcher.kubernetes import manifest

    return yaml.safe_dump(manifest(target, job), sort_keys=False, width=1000)


def _write(output: str | None, text: str, target: str) -> None:
    from dsrun.cli.common import say_stage

    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    Path(output).write_text(text)
    then = f"sbatch {output}" if target == "sbatch" else f"kubectl apply -f {output}"
    say_stage(f"wrote {output}; submit it with: {then}", err=True)
