"""The launcher: from "run this on these machines" to ranks running, supervised, and cleaned up.

Python API (what ``dsrun launch`` and ``dsrun train`` call)::

    from dsrun.launcher import LaunchOptions, plan_launch, run, launch_from_mapping

    plan = plan_launch(LaunchOptions(target="train.py", target_args=["--lr", "0.1"], num_procs=2))
    plan.to_json()        # hosts, world_size, master_addr/port, launcher, commands, env (what --dry-run prints)
    exit_code = run(plan) # 0 when every rank succeeded

    # dsrun train: the RunSpec's ``launcher:`` mapping, the worker module and its arguments
    exit_code = launch_from_mapping(runspec["launcher"], "dsrun.worker", ["--run-dir", run_dir], module=True)

``launcher:`` mapping keys (all optional; see :mod:`dsrun.launcher.options`): ``runner`` (local | ssh |
pdsh | no_ssh | slurm | openmpi | mpich | impi | mvapich | jsrun), ``num_procs``, ``num_nodes``, ``hostfile``,
``include``, ``exclude``, ``master_addr``, ``master_port``, ``node_rank``, ``ssh_port``, ``launcher_args``,
``bind_cores_to_rank``, ``bind_core_list``, ``max_restarts``, ``log_dir``, ``force_multi``,
``elastic_training``, ``min_elastic_nodes``, ``max_elastic_nodes``, ``rdzv_last_call_timeout``,
``rdzv_keep_alive_interval``, ``comment``, ``account``; ``runner: ray`` (``launcher=ray``) takes Ray Train's keys
instead (:mod:`~dsrun.launcher.ray_options`).

Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``CROSS_RANK`` (node index), ``CROSS_SIZE`` (node count) and ``--local_rank=N`` (unless
``no_local_rank``); on CPU ``OMP_NUM_THREADS`` = cores / local ranks unless the user set it.
Layout: :mod:`~dsrun.launcher.hostfile` (hostfile, filters), :mod:`~dsrun.launcher.options`,
:mod:`~dsrun.launcher.environment` (exported variables, env files), :mod:`~dsrun.launcher.plan` (world
plan), :mod:`~dsrun.launcher.runners` (command lines), :mod:`~dsrun.launcher.execute` (running a plan),
:mod:`~dsrun.launcher.mpi` (the MPI runners' command lines), :mod:`~dsrun.launcher.outer` (a rank torchrun,
srun or mpirun started: dsrun becomes it), :mod:`~dsrun.launcher.cluster_job` + :mod:`~dsrun.launcher.kubernetes`
+ :mod:`~dsrun.launcher.sbatch` (``dsrun export-job``: a PyTorchJob/TrainJob/JobSet manifest or an sbatch script
whose ranks become dsrun's through that contract), :mod:`~dsrun.launcher.ray_options` (``launcher=ray``'s keys;
the job itself is :mod:`dsrun.ray`'s),
:mod:`~dsrun.launcher.agent` + :mod:`~dsrun.launcher.supervision` (per-node torch elastic agent),
:mod:`~dsrun.launcher.elastic_agent` (the agent of an elastic job), :mod:`~dsrun.launcher.rank_exec`
(per-rank exec shim, also the rank side of the MPI runners).
"""
from __future__ import annotations

import json
import os
import sys
from typing import IO, Any, Mapping, Sequence

from dsrun.launcher.execute import JobOutcome, run
from dsrun.launcher.options import LaunchOptions, key_path, options_from_mapping
from dsrun.launcher.outer import OuterRank, detect_outer_launcher, launcher_conflicts, outer_plan
from dsrun.launcher.plan import LaunchPlan, plan_launch
from dsrun.launcher.ray_options import RAY_RUNNER, ray_options_from_mapping
from dsrun.utils.errors import Problem, UserError

__all__ = ["LaunchOptions", "LaunchPlan", "plan_launch", "run", "options_from_mapping", "plan_from_mapping",
           "launch_from_mapping", "JobOutcome", "OuterRank", "detect_outer_launcher"]


def plan_from_mapping(mapping: Mapping[str, Any] | None, target: str, target_args: Sequence[str] = (), *,
                      module: bool = False, path: str = "launcher", outer: OuterRank | None = None,
                      **extra: object) -> LaunchPlan:
    """Plan a job from a RunSpec ``launcher:`` mapping; every problem names its RunSpec key path
    (``launcher.num_procs``), not the CLI flag. With ``outer`` (this process is a rank torchrun, srun or mpirun
    started: :mod:`~dsrun.launcher.outer`) the plan is the outer launcher's world and the keys that conflict with
    it are refused. ``runner: ray`` is a job Ray Train starts (:mod:`~dsrun.launcher.ray_options`): its own keys,
    no commands."""
    if (mapping or {}).get("runner") == RAY_RUNNER:
        return _ray_plan(mapping or {}, target, target_args, module=module, path=path, outer=outer)
    options = options_from_mapping(mapping, target, target_args, module=module, path=path, **extra)
    if outer is not None:
        conflicts = launcher_conflicts(mapping, outer, path)
        if conflicts:
            raise UserError(conflicts)
        return outer_plan(options, outer)
    try:
        return plan_launch(options)
    except UserError as err:
        raise UserError([Problem(key_path(p.path, path), p.message, p.hint) for p in err.problems]) from None


def _ray_plan(mapping: Mapping[str, Any], target: str, target_args: Sequence[str], *, module: bool, path: str,
              outer: OuterRank | None) -> LaunchPlan:
    """The plan of a job Ray Train starts: ``num_procs`` workers, on this machine when a local Ray is started for
    it, else on the cluster at ``address`` (whose machines dsrun does not know)."""
    if outer is not None:
        raise UserError(Problem(f"{path}.runner", f"is 'ray', but {outer.launcher} already started this rank "
                                f"({outer.variable('rank')})", f"drop launcher=ray under {outer.launcher}, or "
                                f"run dsrun train launcher=ray outside it"))
    ray = ray_options_from_mapping(mapping, path)
    options = LaunchOptions(target=target, target_args=list(target_args), module=module, num_procs=ray.num_procs)
    # a local Ray is started for the job unless an address is given or RAY_ADDRESS names a running one
    where = "localhost" if ray.address is None and not os.environ.get("RAY_ADDRESS") else "ray"
    return LaunchPlan(hosts={where: list(range(ray.num_procs))}, world_size=ray.num_procs, master_addr="",
                      master_port=0, runner=RAY_RUNNER, commands=[], env={}, options=options,
                      outer=f"launcher=ray: launcher.num_procs={ray.num_procs} Ray Train workers", ray=ray)


def launch_from_mapping(mapping: Mapping[str, Any] | None, target: str, target_args: Sequence[str] = (), *,
                        module: bool = False, dry_run: bool = False, out: IO[str] | None = None,
                        err: IO[str] | None = None, outcome: JobOutcome | None = None, **extra: object) -> int:
    """Plan and run a job from a RunSpec ``launcher:`` mapping; with ``dry_run`` print the plan as JSON
    and start nothing. ``out``/``err``/``outcome`` go to :func:`~dsrun.launcher.execute.run`. Returns the
    exit code; raises :class:`~dsrun.utils.errors.UserError` on bad input."""
    plan = plan_from_mapping(mapping, target, target_args, module=module, **extra)
    if plan.ray is not None:  # no commands to run: Ray Train starts the ranks (dsrun.ray, through dsrun train)
        raise UserError(Problem("launcher.runner", "is 'ray': Ray Train starts the ranks, not dsrun's launcher",
                                "run it with dsrun train launcher=ray, or your own TorchTrainer(dsrun.ray.train_loop)"))
    if dry_run:
        print(json.dumps(plan.to_json(), indent=2))
        sys.stdout.flush()
        return 0
    return run(plan, out=out, err=err, outcome=outcome)
