"""Launch a user script on one or many machines, the way ``deepspeed SCRIPT`` does.

Examples:
  dsrun launch --num_procs 2 train.py --lr 0.1
  dsrun launch -H hostfile --include "worker-1:0,1@worker-2" train.py
  dsrun launch -H hostfile --no_ssh --node_rank 1 --master_addr 10.0.0.1 train.py   (on each node)
  dsrun launch -H hostfile --dry-run train.py     (print the plan as JSON, start nothing)
  dsrun launch -H hostfile --launcher openmpi train.py   (mpirun starts every rank)
  dsrun launch -H hostfile --elastic_training --min_elastic_nodes 1 train.py   (nodes may leave and join)
  dsrun launch --as-deepspeed --num_procs 2 train.py   (an unedited DeepSpeed script: import deepspeed -> dsrun)
  dsrun launch --autotuning run --num_procs 2 train.py --deepspeed ds_config.json   (tune, then train the best)

Under torchrun, srun or mpirun (their rank variables set) it starts no ranks: the script replaces it as that rank,
with --local_rank=N and dsrun's rank variables; flags that conflict with the outer launcher's world are refused
(docs/torchrun.md). Launcher flags come before the script; everything after the script goes to it. When the script's arguments
name a DeepSpeed config (--deepspeed_config FILE), it is checked before any rank starts, as initialize will
check it (the batch sizes excepted: they depend on the data-parallel size, which initialize knows).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from dsrun.launcher.options import (DEFAULT_KEEP_ALIVE_INTERVAL, DEFAULT_LAST_CALL_TIMEOUT, DEFAULT_MASTER_PORT,
                                   KEEP_ALIVE_MISSES, RUNNERS, options_from_args)

if TYPE_CHECKING:
    from dsrun.launcher.outer import OuterRank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.allow_abbrev = False  # a script's own --flags must never be taken for abbreviated launcher flags
    where = parser.add_argument_group("where to run")
    where.add_argument("-H", "--hostfile", default=None,
                       help="hostfile with lines 'HOST slots=N' "
                            "(default /job/hostfile if it exists, else this machine)")
    where.add_argument("-i", "--include", default=None, help='hosts/slots to use: "host[:slot,slot]@host..."')
    where.add_argument("-e", "--exclude", default=None, help='hosts/slots to skip: "host[:slot,slot]@host..."')
    where.add_argument("--num_nodes", type=int, default=None, help="use the first N hosts of the hostfile")
    where.add_argument("--num_procs", "--num_gpus", "--num_accelerators", dest="num_procs", type=int, default=None,
                       help="ranks per node (default: the visible GPUs, or 1 process on CPU)")
    how = parser.add_argument_group("how to start the nodes")
    how.add_argument("--launcher", dest="runner", default=None, type=str.lower,
                     choices=[r for r in RUNNERS if r != "no_ssh"],
                     help="multi-node runner (default: local for one host, ssh for several); openmpi, mpich, "
                          "impi, mvapich and jsrun have mpirun/jsrun start every rank")
    how.add_argument("--launcher_args", default="", help="extra options for ssh / pdsh / srun / mpirun (one string)")
    how.add_argument("--no_ssh", action="store_true",
                     help="start only this node's ranks; run one launcher per node with --node_rank")
    how.add_argument("--node_rank", type=int, default=None, help="this node's index in the hostfile (--no_ssh)")
    how.add_argument("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check before launching")
    how.add_argument("--force_multi", action="store_true",
                     help="use the multi-node runner (ssh by default) even when the job has one host")
    how.add_argument("--comment", default=None, help="srun --comment (slurm runner)")
    how.add_argument("--account", default=None, help="srun --account (slurm runner)")
    how.add_argument("--ssh_port", type=int, default=None, help="ssh port of the nodes")
    how.add_argument("--master_addr", default=None,
                     help="address of node 0 (default 127.0.0.1 on one host, else the first host)")
    how.add_argument("--master_port", type=int, default=None,
                     help=f"rendezvous port on node 0 (default: a free port for a single-node local run, "
                          f"else {DEFAULT_MASTER_PORT})")
    what = parser.add_argument_group("what each rank runs")
    what.add_argument("--module", action="store_true", help="run SCRIPT as a module: python -m SCRIPT")
    what.add_argument("--no_python", action="store_true", help="run SCRIPT directly, not through python")
    what.add_argument("--as-deepspeed", "--as_deepspeed", dest="as_deepspeed", action="store_true",
                      help="make 'import deepspeed' in the script load dsrun (refused if a real DeepSpeed is "
                           "installed); see docs/deepspeed-alias.md")
    what.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    what.add_argument("--bind_cores_to_rank", action="store_true",
                      help="split the node's cores evenly among its ranks and pin each rank to its share")
    what.add_argument("--bind_core_list", default=None, help='cores to split among ranks, e.g. "0-13,16-29"')
    run = parser.add_argument_group("supervision and output")
    run.add_argument("--max_restarts", type=int, default=None,
                     help="restart all ranks up to N times after a failure (default 0; 100 with --elastic_training)")
    run.add_argument("--enable_each_rank_log", dest="log_dir", default=None, metavar="DIR",
                     help="write each rank's stdout/stderr to DIR/rank<R>.{stdout,stderr}.log")
    run.add_argument("--save_pid", action="store_true",
                     help="write the agent and rank PIDs of each node to /tmp/dsrun-<launcher pid>-node<N>.json")
    run.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                     help="print the launch plan as JSON and start nothing")
    elastic = parser.add_argument_group("elastic training (docs/elasticity.md)")
    elastic.add_argument("--elastic_training", action="store_true",
                         help="nodes may leave and join while the job runs; the ranks restart at the new world size")
    elastic.add_argument("--min_elastic_nodes", type=int, default=None, help="fewest nodes to train on (default 1)")
    elastic.add_argument("--max_elastic_nodes", type=int, default=None,
                         help="most nodes to train on (default: the nodes planned)")
    elastic.add_argument("--rdzv_last_call_timeout", type=float, default=DEFAULT_LAST_CALL_TIMEOUT, metavar="S",
                         help="seconds a rendezvous with enough nodes waits for more (default %(default)g)")
    elastic.add_argument("--rdzv_keep_alive_interval", type=int, default=None, metavar="S",
                         help=f"seconds between a node's rendezvous heartbeats; {KEEP_ALIVE_MISSES} missed in a row: "
                              f"the node left (default {DEFAULT_KEEP_ALIVE_INTERVAL})")
    parser.add_argument("--autotuning", choices=["tune", "run"], default=None,
                        help="tune the script's DeepSpeed config (its 'autotuning' section) with dsrun's tuner; run: "
                             "then launch it with the best config (docs/autotuning.md)")
    parser.add_argument("script", help="the script to run (a module name with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run(args: argparse.Namespace) -> int:
    from dsrun.launcher import detect_outer_launcher, plan_launch, run as run_plan
    from dsrun.launcher.execute import JobOutcome, stopped_message
    from dsrun.utils.errors import Problem, UserError

    if args.no_ssh and args.runner not in (None, "local"):
        raise UserError(Problem("--no_ssh", f"cannot be combined with --launcher {args.runner}"))
    outer = detect_outer_launcher()
    if args.as_deepspeed:
        import os

        from dsrun.alias import environment_with_alias
        from dsrun.alias.commands import environment_with_bin, temporary_bin

        # every rank inherits (and every node is sent) PYTHONPATH, see dsrun.launcher.environment; ranks this
        # process launches also find DeepSpeed's commands (deepspeed, ds_report, ds_elastic) first on PATH. A rank
        # of an outer launcher replaces itself with the script (execvp), which would leave a temporary folder
        # behind on every rank: it gets the alias alone
        environ = environment_with_alias(dict(os.environ))
        os.environ.update(environ if outer is not None else environment_with_bin(environ, temporary_bin()))
    if outer is not None:  # torchrun, srun or mpirun made this process a rank: it becomes the script
        return _become_rank(args, outer)
    plan = plan_launch(options_from_args(args))
    if args.autotuning and not args.dry_run:  # DeepSpeed's autotuner on this script (docs/autotuning.md)
        from dsrun.cli import launch_autotuning

        return launch_autotuning.run(args, plan.world_size, add_arguments)
    check_script_config(args.script_args, plan.world_size)
    if args.dry_run:  # with --autotuning: the plan every experiment (and the final run) launches with
        print(json.dumps({**plan.to_json(), **({"autotuning": args.autotuning} if args.autotuning else {})}, indent=2))
        return 0
    outcome = JobOutcome()
    code = run_plan(plan, outcome=outcome)
    if outcome.user_errors:  # a rank's report of the user's mistake: once, as the CLI words any UserError
        raise UserError(outcome.user_errors)
    if outcome.signal is not None:
        print(stopped_message(plan, outcome.signal), file=sys.stderr)
    return code


def _become_rank(args: argparse.Namespace, outer: OuterRank) -> int:
    """Under an outer launcher: refuse the flags that conflict with its world, then replace this process with the
    script (``execvp``), given the variables a rank of dsrun's agent has (docs/torchrun.md)."""
    import os

    from dsrun.launcher.outer import launch_conflicts, rank_argv
    from dsrun.utils.errors import Problem, UserError

    options = options_from_args(args)
    problems = launch_conflicts(options, outer)
    if args.dry_run or args.autotuning:
        flag = "--dry-run" if args.dry_run else "--autotuning"
        problems.append(Problem(flag, f"is not run as a rank of {outer.launcher} ({outer.variable('rank')})",
                                f"run dsrun launch {flag} outside {outer.launcher}"))
    if problems:
        raise UserError(problems)
    check_script_config(args.script_args, outer.world_size)
    os.environ.update(outer.environment())
    argv = rank_argv(options, outer)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        raise UserError(Problem("script", f"cannot start {argv[0]!r}: {err.strerror}")) from None
    return 0  # not reached: execvp replaced this process


CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")


def script_config_path(script_args: list[str]) -> str | None:
    """The DeepSpeed config file the script's arguments name (``--deepspeed_config FILE`` or ``=FILE``)."""
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_FLAGS:
            if eq:
                return value
            return script_args[i + 1] if i + 1 < len(script_args) else None
    return None


def check_script_config(script_args: list[str], world_size: int | None = None) -> None:
    """Validate the script's DeepSpeed config file, if it names one that exists: the same loading
    ``dsrun.initialize`` does. Raises the ConfigError (exit code 2); prints the warnings of a config with
    ``dsrun_allow_unimplemented`` once, so the ranks do not repeat them.

    The batch arithmetic needs the data-parallel size, which the script decides (pipeline or model
    parallelism take a share of the ``world_size`` ranks): it is refused here only when no data-parallel size
    that divides ``world_size`` fits, so every rank would refuse it."""
    from pathlib import Path

    from dsrun.config import announce, load_ds_config
    from dsrun.config.batch import GAS, MBS, TBS
    from dsrun.utils.errors import ConfigError

    path = script_config_path(script_args)
    if path is None or not Path(path).is_file():
        return
    config = load_ds_config(path, world_size=None, world_size_source="dsrun launch")
    announce(config, for_children=True)
    if not world_size or config.elasticity.enabled:  # elasticity picks its own batch for the world
        return
    batch_keys = {TBS, MBS, GAS}
    refusals = []
    for data_parallel in [d for d in range(world_size, 0, -1) if world_size % d == 0]:
        try:
            load_ds_config(path, world_size=data_parallel, world_size_source=f"dsrun launch: {world_size} ranks"
                           + ("" if data_parallel == world_size else f", {data_parallel} of them data-parallel"))
            return
        except ConfigError as err:
            if any(problem.path not in batch_keys for problem in err.problems):
                return  # not the arithmetic: the ranks say what it is
            refusals.append(err)
    raise refusals[0]  # the arithmetic at every data-parallel size: the pure data-parallel one says it best
