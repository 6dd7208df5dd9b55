"""The rank entry point: a run directory's RunSpec → model and data → ``dsrun.initialize`` → training loop.

``dsrun train`` writes the run directory and launches ``python -m dsrun.worker --run-dir RUN_DIR`` once per
rank (under torchrun, srun or mpirun each rank's ``dsrun train`` calls :func:`main` itself: docs/torchrun.md; under
Ray Train each worker calls :func:`run`: :mod:`dsrun.ray`). The loop reads top to bottom and names no feature: the run's workload (:mod:`dsrun.workloads`: the
dense GPT, the pipelined GPT or a distillation) builds the model, then for each optimizer step its ``step``
runs the micro-steps of forward / backward and one ``engine.step()`` (a pipeline: its schedule), the loop
evaluates now and then, and at the end writes ``metrics.json`` (rank 0). Each rank records its groups and
partitions (``topology_rank<R>.json``, what ``dsrun train --dry-run`` prints). A stop signal on any rank stops
every rank at the next step boundary; the metrics gathered so far are still written. SIGTERM or SIGUSR1 (a
scheduler's preemption) saves a checkpoint there even when periodic saving is off, within
``train.preemption.grace_s``, and the rank exits with 138 (``EXIT_PREEMPTED``: requeue, the same command
resumes); SIGINT (Ctrl-C) saves only when saving is on. A rank stopped without that checkpoint exits with 143.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from dsrun.config import load_resolved
from dsrun.estimate.measure import current_rss, record_rank_peak
from dsrun.launcher.protocol import (EXIT_PREEMPTED, EXIT_STOPPED, PREEMPTION_SIGNALS, STOP_SIGNALS, debug_requested,
                                     exit_without_teardown, report_user_error)
from dsrun.monitor.run_defaults import PARENT_ENV, apply_run_defaults, flatten, mlflow_parent_key
from dsrun.run_book import RunBook, StepReporter
from dsrun.rundir import RESOLVED_YAML
from dsrun.runspec import PreemptionSpec
from dsrun.utils.errors import EXIT_USAGE, find_user_error
from dsrun.workloads import compose, topology
from dsrun.workloads.pipeline import pipeline_stages
from dsrun.utils.seeding import set_random_seed
from dsrun.workloads.base import collective_device, mean_across_ranks

if TYPE_CHECKING:
    from torch import nn

    from dsrun.engine.engine import DeepSpeedEngine
    from dsrun.profiling.mfu import ModelFlopsMeter


class StopFlag:
    """The stop signals (``STOP_SIGNALS``: SIGINT, SIGTERM, SIGUSR1); the loop checks them between optimizer
    steps, and the first one this rank gets counts. ``notices``: the engine's preemption notice (Ray's node drain,
    :meth:`dsrun.run_book.StepReporter.notice`), asked by every rank at every step boundary; a notice counts as
    SIGTERM.

    A preemption signal (SIGTERM, SIGUSR1) starts the grace period, ``train.preemption.grace_s``: a rank that has
    not saved the checkpoint where it stops when the period ends calls ``on_expiry`` (the run's record of it),
    says so in one line and exits with 143 at once (a save cut short never replaces ``latest``). A rank that
    learns of the preemption only when the ranks agree to stop starts its period then. The watch is a daemon
    thread that waits on an event the handler sets: nothing but the flag and the event is touched in the handler.
    """

    def __init__(self, grace_s: float = PreemptionSpec().grace_s,
                 notices: Callable[[], str | None] | None = None) -> None:
        self.signal: int | None = None
        self.grace_s = grace_s
        # the engine's preemption notice (StepReporter.notice: Ray's node drain), asked at every step boundary
        self.notices = notices
        self.notice: str | None = None
        self.on_expiry: Callable[[], str] | None = None  # records the expiry; returns the line that says it
        self._preempted, self._settled = threading.Event(), threading.Event()
        self.since: float | None = None
        # Python lets only the main thread set handlers; a loop run in another thread (Ray Train's worker, dsrun.ray)
        # leaves the signals to whoever owns that process (docs/cluster.md, "Ray")
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)
        threading.Thread(target=self._watch, name="dsrun-preemption-grace", daemon=True).start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum
            if signum in PREEMPTION_SIGNALS:
                self.start_grace()

    def __bool__(self) -> bool:
        return self.signal is not None

    def start_grace(self) -> None:
        """Start the grace period (once)."""
        if self.since is None:
            self.since = time.monotonic()
            self._preempted.set()

    def settle(self) -> None:
        """The checkpoint a preemption asked for is saved: the grace period no longer applies."""
        self._settled.set()

    def agreed(self) -> int:
        """The stop every rank agrees on at a step boundary, so no rank is left waiting in a collective: 0 (go
        on), or the signal the run stops for. A preemption signal on any rank wins over Ctrl-C; a rank that learns
        of it here starts its grace period."""
        from dsrun import comm

        if self.notices is not None:  # collective in the engine's own terms: every rank asks, every step
            heard = self.notices()  # asked even once heard: every rank calls the collective as often
            self.notice = self.notice or heard
            if self.notice is not None and self.signal is None:
                self.signal = signal.SIGTERM  # the scheduler takes the machine back, as Kubernetes' SIGTERM says
        rank_stop = 0 if self.signal is None else self.signal + (100 if self.signal in PREEMPTION_SIGNALS else 0)
        flag = torch.tensor([float(rank_stop)], device=collective_device())
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        signum = int(flag.item()) % 100
        if signum in PREEMPTION_SIGNALS:
            self.start_grace()
        return signum

    def _watch(self) -> None:
        self._preempted.wait()
        if self._settled.wait(self.grace_s):
            return
        line = self.on_expiry() if self.on_expiry is not None else (
            f"[dsrun] {signal.Signals(self.signal or signal.SIGTERM).name}: the ranks did not reach a step "
            f"boundary within train.preemption.grace_s={self.grace_s:g} s; stopping without a checkpoint")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_STOPPED)  # the main thread may be inside a collective or a write: no teardown


def _train_step_flops(model: nn.Module, batch_size: int, seq_len: int) -> int | None:
    """Analytic forward+backward FLOPs of one optimizer step (dsrun's GPT only), for the TFLOPs metric."""
    from dsrun.models.accounting import train_step_flops

    try:
        return train_step_flops(model, batch_size, seq_len)
    except TypeError:
        return None


def model_flops_meter(engine: DeepSpeedEngine, model: nn.Module, batch_size: int, seq_len: int,
                      world_size: int) -> ModelFlopsMeter | None:
    """MFU's parts for dsrun's GPT (None for another model): the model FLOPs of one step (PaLM's, no
    recompute) and one device's peak, the table's for a known GPU or the matmul probe's at the run's dtype and
    threads, which every rank runs at once (as they will train) and which is averaged over the ranks."""
    from dsrun.models.accounting import model_step_flops
    from dsrun.profiling.mfu import DevicePeak, ModelFlopsMeter, device_peak

    try:
        flops = model_step_flops(model, batch_size, seq_len)
    except TypeError:
        return None
    peak = device_peak(engine.device, engine.precision.model_dtype)
    return ModelFlopsMeter(flops, DevicePeak(mean_across_ranks(peak.flops), peak.source), world_size)


def report_throughput(engine: DeepSpeedEngine, steps: int, elapsed: float, tokens_per_step: int,
                      step_flops: int | None) -> tuple[float, float]:
    """Samples/s and tokens/s over the ``steps`` run so far; also sent to the monitors (with TFLOPs)."""
    samples_s, tokens_s = steps * engine.train_batch_size() / elapsed, steps * tokens_per_step / elapsed
    events = [("Train/Samples/samples_per_second", samples_s, engine.global_samples),
              ("Train/Samples/tokens_per_second", tokens_s, engine.global_samples)]
    if step_flops:
        events.append(("Train/Samples/tflops", steps * step_flops / elapsed / 1e12, engine.global_samples))
    engine.monitor.write_events(events)
    return samples_s, tokens_s


def step_timer_ms(engine: DeepSpeedEngine, before: dict[str, float] | None) -> dict[str, float] | None:
    """The engine's forward/backward/step timer totals (``wall_clock_breakdown``) now, minus ``before``;
    None when the timers are off, or when the engine reset them at the end of this step (every
    ``steps_per_print`` steps), which loses the step's figures."""
    if not engine.timers.enabled:
        return None
    now = {name: engine.timers.elapsed_ms(name) for name in ("forward", "backward", "step")}
    if before is None:
        return now
    every = engine.steps_per_print() or 1  # None: the observer reports (and resets) every step
    return None if engine.global_steps % every == 0 else {k: v - before[k] for k, v in now.items()}


def train(spec: DictConfig, run_dir: Path, reporter: StepReporter | None = None,
          restart_from: Path | None = None) -> dict[str, Any]:
    """Train the run ``spec`` as this rank (the process group is made here unless the caller's engine made it:
    Ray Train's); ``reporter`` hears of the evaluations, checkpoints and last step, ``restart_from`` is a
    checkpoint tag folder to resume from
    (both: dsrun.ray)."""
    import hydra.utils

    import dsrun
    from dsrun import comm

    cfg = spec.train
    # a run directory composed before train.preemption existed (dsrun train --from an old run) has the default
    stop = StopFlag(PreemptionSpec.model_validate(OmegaConf.to_container(cfg).get("preemption") or {}).grace_s,
                    notices=reporter.notice if reporter is not None else None)
    dsrun.init_distributed()
    rank, world_size = comm.get_rank(), comm.get_world_size()
    set_random_seed(cfg.seed)
    baseline_rss = current_rss()  # for `dsrun estimate-memory --measure`: this rank's peak above start-up

    # --- model, data, engine: the workload (dense GPT, pipelined GPT or distillation: dsrun/workloads/) ---
    ds_config = apply_run_defaults(OmegaConf.to_container(spec.ds, resolve=True), run_dir)  # monitors → run dir
    # this rank's one parse of the config; what it hands on carries the typed config (dsrun.config)
    # the batch sizes count data-parallel ranks: not a pipeline's stages, nor an AutoTP group's ranks
    autotp = max(1, int((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 1))
    ds_config = load_resolved(ds_config, world_size // pipeline_stages(spec.model) // autotp)
    workload = compose(spec, ds_config, world_size)
    model = workload.build_model()
    corpus = hydra.utils.instantiate(spec.data, _convert_="all")
    corpus.check_vocab(model.config.vocab_size)
    if mlflow_parent_key(run_dir):  # the jobs of a multirun become MLflow child runs of one parent
        os.environ[PARENT_ENV] = mlflow_parent_key(run_dir)
    engine, _, _, _ = dsrun.initialize(**workload.engine_inputs(corpus, run_dir))  # data efficiency's indexes
    topology.write(run_dir, topology.describe(engine))  # groups and partitions, as `dsrun train --dry-run` shows
    workload.attach(engine)  # random-LTD layers, seqlen truncation, token counts; this rank's data shard
    engine.monitor.log_params(flatten(OmegaConf.to_container(spec, resolve=True)))
    loader = workload.train_loader(corpus)

    # --- the run's budget and its bookkeeping (metrics, progress, evaluation, checkpoints: dsrun/run_book.py) ---
    tokens_per_step = engine.train_batch_size() * corpus.seq_len
    max_steps = cfg.max_steps
    if cfg.max_tokens:
        max_steps = min(max_steps, math.ceil(cfg.max_tokens / tokens_per_step))
    book = RunBook(engine, loader, run_dir, cfg, max_steps, tokens_per_step, num_params=workload.num_params(),
                   step_flops=_train_step_flops(model, engine.train_batch_size(), corpus.seq_len),
                   evaluate=lambda: workload.evaluate(corpus, cfg.eval_iters),
                   report_throughput=report_throughput, step_timers=step_timer_ms,
                   mean_across_ranks=mean_across_ranks, stop=stop, world_size=world_size,
                   eval_counts=workload.eval_counts,  # tokens and layer-tokens seen at each evaluation
                   flops_meter=model_flops_meter(engine, model, engine.train_batch_size(), corpus.seq_len, world_size),
                   reporter=reporter, restart_from=restart_from)
    stop.on_expiry = book.grace_expired  # records where the preempted run stood, says so in one line
    book.announce(type(model).__name__, corpus.seq_len)
    first_step = book.resume()
    book.evaluate_first()

    # --- the training loop ---
    stopped = False
    for step in range(first_step, max_steps + 1):
        book.step_begins()
        step_loss = workload.step(loader)  # the step's micro-batches (or the pipeline's schedule), one update
        stopped = book.step_ends(step, step_loss)  # metrics, eval, progress, checkpoint; all ranks agree to stop
        if stopped:
            break

    metrics = book.finish((stop.signal or "another rank") if stopped else None,
                          record_peak=lambda: record_rank_peak(run_dir, rank, baseline_rss),
                          extra_metrics=workload.extra_metrics())
    comm.barrier()
    comm.destroy_process_group()
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsrun.worker", description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory dsrun train wrote")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the launcher (also LOCAL_RANK)")
    args = parser.parse_args(argv)
    return run(args.run_dir)


def run(run_dir: Path, reporter: StepReporter | None = None, restart_from: Path | None = None) -> int:
    """Train as this rank of the run in ``run_dir`` (:func:`train`'s arguments); returns the rank's exit code."""
    spec = OmegaConf.load(run_dir / RESOLVED_YAML)
    # dsrun train said it once before the launch (dsrun.cli.preflight.warmup_note), not once per rank
    warnings.filterwarnings("ignore", message=r"total_num_steps \d+ is less than warmup_num_steps")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        metrics = train(spec, run_dir, reporter, restart_from)
    except Exception as err:  # the user's mistake: one line through the launcher, exit code 2, no traceback
        user = find_user_error(err)
        if user is None:
            raise
        if debug_requested():
            import traceback

            traceback.print_exc()
        report_user_error([str(problem) for problem in user.problems])
        return EXIT_USAGE
    if (metrics.get("preempted") or {}).get("saved"):
        return EXIT_PREEMPTED  # preempted, checkpoint saved where the ranks stopped: requeue
    return EXIT_STOPPED if metrics.get("stopped_by_signal") else 0


if __name__ == "__main__":
    exit_without_teardown(main())
