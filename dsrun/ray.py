"""dsrun's worker as Ray Train workers: ``dsrun train launcher=ray``, and :func:`train_loop` for your own
``TorchTrainer`` (docs/cluster.md, "Ray"). Needs the optional extra: ``pip install 'dsrun[ray]'``.

Ray starts the ranks and forms their process group (``TorchTrainer``'s torch backend: gloo on CPU, NCCL with
GPUs); each worker runs the worker's loop (:func:`dsrun.worker.run`) on that group, as a rank of dsrun's own
launcher would. The steps that leave something to keep are reported to Ray (``ray.train.report``: step, loss, lr,
and the eval loss when it evaluated) besides dsrun's own monitors, which see every step: each evaluation, each
checkpoint and the last step (Ray Train takes one report per look at its workers, every
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default, so a report every step would hold each step that long).
Each checkpoint dsrun saves (``train.save_interval``) is registered with Ray as it is reported
(``Checkpoint.from_directory`` of the tag folder, rank 0's report, so the run directory must be one every worker
reads and writes, as for any multi-node dsrun run). When a worker fails,
``FailureConfig(max_failures=N)`` lets Ray restart the group; the new workers resume from the checkpoint Ray
registered last (``ray.train.get_checkpoint()``), exactly as a resumed dsrun run does. Ray's preemption notice (a
node of the group drained: a spot reclaim, ``ray drain-node``) is asked at every step boundary
(``ray.train.get_preemption_info()``, :meth:`RayReporter.notice`): the ranks stop there, save and register a
checkpoint, and wait for Ray to restart the group from it (:meth:`RayReporter.hold_until_restarted`).

Your own trainer::

    import dsrun.ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = dsrun.ray.prepare_run(["+recipe=gpt_zero3", "train.max_steps=200", "train.save_interval=50"],
                                   num_workers=4, run_dir="/shared/runs/gpt")
    trainer = TorchTrainer(dsrun.ray.train_loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=4),
                           run_config=RunConfig(storage_path="/shared/ray", failure_config=FailureConfig(max_failures=3)))
    result = trainer.fit()   # result.metrics: the last report's; result.checkpoint: dsrun's last checkpoint

:func:`prepare_run` composes and checks the recipe for ``num_workers`` ranks and writes the run directory
(``resolved.yaml``, ``ds_config.json``), as ``dsrun train`` does before it launches; :func:`train_loop` refuses a
trainer whose ``num_workers`` differs (the batch sizes were resolved for the prepared world).
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dsrun.launcher.protocol import EXIT_PREEMPTED
from dsrun.launcher.ray_options import INSTALL_HINT, RayOptions
from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from ray.train import Result

RUN_DIR_KEY = "run_dir"  # train_loop_config's key: the prepared run directory
# Ray Train's own wait for a drain that names no deadline (DEFAULT_PREEMPTION_DEADLINE_S), and the time a worker
# that saved for the notice waits beyond the drain's deadline for Ray to end its group before it raises
DRAIN_DEFAULT_DEADLINE_S = 120.0
HOLD_MARGIN_S = 120.0
STORAGE_NAME = "ray"     # the folder (under the run directory by default) where Ray keeps what it registers


def _import_ray_train() -> Any:
    try:
        import ray.train
        import ray.train.torch  # noqa: F401  (TorchTrainer's backend)
    except ImportError as err:
        raise UserError(Problem("launcher.runner", f"is 'ray', but Ray Train is not importable ({err})",
                                INSTALL_HINT)) from None
    return ray.train


class RayReporter:
    """A :class:`~dsrun.run_book.StepReporter` that tells Ray of the steps the run reports; rank 0 registers each checkpoint
    (the tag folder, which holds every rank's files once the save returned), under the tag's own name. Its
    :meth:`notice` is Ray's preemption notice, ``ray.train.get_preemption_info()``: a node of the group drained."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.train = _import_ray_train()
        self.preemption: Any = None  # Ray's PreemptionInfo once a node of the group is drained

    def notice(self) -> str | None:
        """``ray.train.get_preemption_info()`` (a barrier across the workers: every rank asks at every step
        boundary), as one line: the drained nodes, their ranks and the deadline. None until a node of the group is
        drained, and with a Ray that has no such call."""
        ask = getattr(self.train, "get_preemption_info", None)
        info = ask() if ask is not None else None
        if info is None:
            return None
        self.preemption = info
        deadline = ("no deadline" if info.deadline_ms is None else
                    f"reclaimed at {time.strftime('%H:%M:%S', time.localtime(info.deadline_ms / 1000))}")
        return (f"Ray: node(s) {', '.join(node[:12] for node in info.preempted_node_ids)} drained (ranks "
                f"{', '.join(map(str, info.preempted_ranks))}; {deadline})")

    def hold_until_restarted(self, margin_s: float = HOLD_MARGIN_S) -> None:
        """After the checkpoint a drain asked for: train no further and wait for Ray to end the group, which it does
        once the drain's deadline passed (its own default, 120 s after the notice, when the drain named none; plus
        ``FailureConfig.preemption_grace_s``), then restarts it from that checkpoint (a preemption, counted against
        ``FailureConfig.max_preemption_failures``, not ``max_failures``). A worker that returned would end the run as
        finished, one that raised would count as a failure. Raises if Ray has not ended it ``margin_s`` after that."""
        info = self.preemption
        deadline = time.time() + DRAIN_DEFAULT_DEADLINE_S if info.deadline_ms is None else info.deadline_ms / 1000
        waited = max(0.0, deadline - time.time()) + margin_s
        print(f"[dsrun] rank {self.rank}: checkpoint saved for Ray's preemption notice; waiting for Ray to restart "
              "the group from it", flush=True)
        time.sleep(waited)
        raise RuntimeError(f"Ray did not restart the preempted group within {waited:.0f} s of the checkpoint its "
                           "notice asked for (FailureConfig.preemption_grace_s longer than that?)")

    def report(self, step: int, metrics: dict[str, float], checkpoint: Path | None) -> None:
        if checkpoint is None:
            self.train.report(metrics)
            return
        registered = self.train.Checkpoint.from_directory(str(checkpoint)) if self.rank == 0 else None
        # dsrun keeps its own copy (train.keep_last prunes it); Ray's lives in its storage
        self.train.report(metrics, checkpoint=registered, checkpoint_dir_name=checkpoint.name,
                          delete_local_checkpoint_after_upload=False)


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: train as its rank of the run prepared in ``config["run_dir"]``
    (:func:`prepare_run`), on the process group Ray formed; resume from the checkpoint Ray registered last when
    the group was restarted. Raises when the rank does not finish (Ray counts it a worker failure)."""
    from omegaconf import OmegaConf

    from dsrun import worker
    from dsrun.rundir import RESOLVED_YAML

    train = _import_ray_train()
    run_dir = Path(config[RUN_DIR_KEY])
    context = train.get_context()
    prepared = OmegaConf.select(OmegaConf.load(run_dir / RESOLVED_YAML), "launcher.num_procs")
    if prepared != context.get_world_size():
        raise UserError(Problem("ScalingConfig.num_workers", f"is {context.get_world_size()}, but the run in "
                                f"{run_dir} was prepared for launcher.num_procs={prepared} ranks (its batch sizes "
                                f"are resolved for them)", f"prepare it with num_workers={context.get_world_size()}, "
                                f"or give the trainer num_workers={prepared}"))
    checkpoint = train.get_checkpoint()
    reporter = RayReporter(context.get_world_rank())
    with checkpoint.as_directory() if checkpoint is not None else contextlib.nullcontext() as restored:
        code = worker.run(run_dir, reporter, Path(restored) if restored else None)
    if code == EXIT_PREEMPTED and reporter.preemption is not None:  # saved and registered where Ray's notice came
        reporter.hold_until_restarted()
    if code != 0:
        raise RuntimeError(f"dsrun's worker (rank {context.get_world_rank()}) exited with code {code}; its lines "
                           f"above say why")


def prepare_run(overrides: Sequence[str], num_workers: int, run_dir: str | os.PathLike,
                recipes_dirs: Sequence[str | os.PathLike] = ()) -> dict[str, Any]:
    """Compose ``dsrun train``'s recipe with ``overrides`` for ``num_workers`` Ray Train workers, check it and
    write its run directory (``resolved.yaml``, ``ds_config.json``); returns the ``train_loop_config`` for
    :func:`train_loop`. A bad key raises :class:`~dsrun.utils.errors.UserError` naming it; so does a ``launcher``
    override: your trainer's ``ScalingConfig`` and ``RunConfig`` say how Ray runs the workers."""
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run

    launcher = [item for item in overrides if item.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "launcher"]
    if launcher:
        raise UserError([Problem(item.split("=", 1)[0].lstrip("+~"), "is set by prepare_run (launcher=ray, launcher.num_procs="
                                 "num_workers)", "leave it out: your TorchTrainer's ScalingConfig and RunConfig say "
                                 "how Ray runs the workers") for item in launcher])
    folder = Path(run_dir).expanduser().resolve()
    resolved = resolve_run(compose_runspec([*overrides, "launcher=ray", f"launcher.num_procs={num_workers}"],
                                           [str(d) for d in recipes_dirs]))
    folder.mkdir(parents=True, exist_ok=True)
    write_run_files(folder, resolved)
    return {RUN_DIR_KEY: str(folder)}


def fit(run_dir: Path, options: RayOptions, keep_last: int = 0) -> Result:
    """``dsrun train launcher=ray``: train the run in ``run_dir`` on ``options.num_procs`` Ray Train workers.
    Connects to the cluster at ``options.address`` (or ``RAY_ADDRESS``), else starts a local Ray on
    ``options.local_cpus()`` CPUs for the job and stops it at the end. Ray keeps the checkpoints it registers
    in the run directory's ``ray/`` (or ``options.storage_path``'s ``DATE_TIME/``, the run directory's last two
    parts), the newest ``keep_last``
    (``train.keep_last``; 0: all). Returns Ray's result; raises Ray's ``TrainingFailedError`` when the workers
    failed more often than ``options.max_failures`` allows, or their nodes were drained more often than
    ``options.max_preemption_failures`` allows."""
    import inspect

    import ray

    train = _import_ray_train()
    from ray.train.torch import TorchTrainer

    failures = {"max_failures": options.max_failures}
    if options.max_preemption_failures != -1:  # Ray's own default: no limit
        if "max_preemption_failures" not in inspect.signature(train.FailureConfig).parameters:
            raise UserError(Problem("launcher.max_preemption_failures", f"is {options.max_preemption_failures}, "
                                    f"but Ray {ray.__version__} has no preemption restarts "
                                    "(FailureConfig.max_preemption_failures)", "upgrade Ray, or leave it at -1"))
        failures["max_preemption_failures"] = options.max_preemption_failures

    started = not ray.is_initialized()
    if started:
        address = options.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=True)
        else:  # a Ray of this job's own, on no more CPUs than its workers take
            ray.init(num_cpus=options.local_cpus(), include_dashboard=False, log_to_driver=True)
    run_dir = run_dir.resolve()
    # a storage of the run's own holds one experiment; a shared one, one per run directory (Hydra's DATE/TIME)
    name = STORAGE_NAME if options.storage_path is None else f"{run_dir.parent.name}_{run_dir.name}"
    try:
        trainer = TorchTrainer(
            train_loop, train_loop_config={RUN_DIR_KEY: str(run_dir)},
            scaling_config=train.ScalingConfig(num_workers=options.num_procs, use_gpu=options.use_gpu,
                                               resources_per_worker=options.resources_per_worker or None),
            run_config=train.RunConfig(
                name=name, storage_path=str(Path(options.storage_path or run_dir).expanduser().resolve()),
                failure_config=train.FailureConfig(**failures),
                checkpoint_config=train.CheckpointConfig(num_to_keep=keep_last or None)))
        return trainer.fit()
    finally:
        if started:
            ray.shutdown()
