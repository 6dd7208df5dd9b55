"""The bookkeeping around ``dsrun.worker``'s training loop, so the loop itself reads top to bottom.

:class:`RunBook` records what a run reports (losses, learning rates, step times and timers, evaluations,
throughput), prints the progress lines, saves checkpoints on schedule, agrees with the other ranks when to stop
(a stop signal on any rank), and at the end writes ``metrics.json`` and the run's reports. A preemption (SIGTERM
or SIGUSR1) saves a checkpoint where the ranks stop, even with periodic saving off, and rank 0 records it in
``preempted.json`` (the signal, the step, whether the checkpoint there was saved), also when the grace period
ran out first. Every checkpoint save is recorded (``checkpoint_saves``: the step, the seconds training waited
for it, the seconds until it was published, its bytes) in ``metrics.json`` and sent to the monitors
(``Checkpoint/Samples/blocking_s``, ``write_s``, ``bytes``); a decoupled save's write is waited for at the end.
An engine's preemption notice (:meth:`StepReporter.notice`: Ray's node drain) stops the ranks as SIGTERM does, and
``preempted.json`` names it (``notice``).
With a :class:`~dsrun.profiling.mfu.ModelFlopsMeter` (dsrun's GPT) it says the device's peak once at start and adds
the model's TFLOP/s per device and MFU to every progress line, the monitors and ``metrics.json``. A
:class:`StepReporter` (Ray Train's, :mod:`dsrun.ray`) is told of each evaluation, each checkpoint (the folder
saved) and the last step.
"""
from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from dsrun.checkpoint import layout
from dsrun.checkpoint.training import TrainingCheckpoints
from dsrun.launcher.protocol import PREEMPTION_SIGNALS
from dsrun.monitor.progress import TrainingProgress
from dsrun.rundir import DS_CONFIG_JSON, METRICS_JSON, PREEMPTED_JSON, RESOLVED_YAML, atomic_write_text
from dsrun.engine.observer import write_run_reports
from dsrun.runspec import TrainSpec

if TYPE_CHECKING:
    from dsrun.engine.engine import DeepSpeedEngine
    from dsrun.profiling.mfu import FlopsRate, ModelFlopsMeter


class ResumableLoader(Protocol):
    """The training data loader as the checkpoints see it: its position saves and loads with the run."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StopSignals(Protocol):
    """The stop signals as the loop sees them (``dsrun.worker.StopFlag``)."""

    grace_s: float
    signal: int | None  # the stop signal this rank got itself, if any
    notice: str | None  # the engine's preemption notice the ranks stopped for (Ray's node drain), if any

    def agreed(self) -> int:
        """Collective: 0 to go on, else the signal every rank stops for."""

    def settle(self) -> None:
        """The checkpoint a preemption asked for is saved: its grace period ends."""


class StepReporter(Protocol):
    """Someone outside the run told of the steps that leave something to keep, on every rank at once: each
    evaluation, each checkpoint and the step the run ends or stops after (not every step: Ray Train, the one
    reporter, :mod:`dsrun.ray`, takes one report per look at its workers, every 2 s by default, and a rank
    reporting faster would wait for it)."""

    def report(self, step: int, metrics: dict[str, float], checkpoint: Path | None) -> None:
        """``metrics``: the step's number, mean training loss, learning rate (and eval loss when it evaluated);
        ``checkpoint``: the tag folder saved after this step, complete on every rank, or None."""

    def notice(self) -> str | None:
        """Collective, asked by every rank at every step boundary before the ranks agree whether to stop: the
        engine's notice that it takes the ranks' machines back (Ray's node drain), in one line, or None. A notice
        stops the run as SIGTERM does: a checkpoint at that boundary, then exit code 138."""


class RunBook:
    """Everything a rank records about its run besides training itself."""

    def __init__(self, engine: DeepSpeedEngine, loader: ResumableLoader, run_dir: Path, cfg: TrainSpec,
                 max_steps: int, tokens_per_step: int, num_params: int, step_flops: int | None,
                 evaluate: Callable[[], float], report_throughput: Callable[..., tuple[float, float]],
                 step_timers: Callable[..., Any], mean_across_ranks: Callable[[float], float],
                 stop: StopSignals, world_size: int, eval_counts: Callable[[], dict[str, Any]] = dict,
                 flops_meter: ModelFlopsMeter | None = None, reporter: StepReporter | None = None,
                 restart_from: Path | None = None):
        self.engine, self.run_dir, self.max_steps = engine, run_dir, max_steps
        self.tokens_per_step, self.step_flops, self.flops_meter = tokens_per_step, step_flops, flops_meter
        self._evaluate, self._throughput, self._timers = evaluate, report_throughput, step_timers
        self._mean, self._stop, self._eval_counts = mean_across_ranks, stop, eval_counts
        self._reporter = reporter
        self.rank = engine.global_rank
        self.eval_every = cfg.eval_interval or max_steps
        self.metrics: dict[str, Any] = {
            "train_losses": [], "eval_losses": [], "lrs": [], "world_size": world_size,
            "tokens_per_step": tokens_per_step, "max_steps": max_steps, "loss_unit": "nats per token",
            "train_batch_size": engine.train_batch_size(),
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(), "num_params": num_params,
            "step_flops": step_flops, "step_times_ms": [], "step_timers_ms": []}  # per step, for dsrun tune
        if flops_meter is not None:  # MFU's numerator per step, and its denominator per device
            self.metrics.update(model_flops_per_step=flops_meter.flops_per_step,
                                peak_flops_per_device=flops_meter.peak.flops, peak_source=flops_meter.peak.source)
        # checkpoints: resume before the first step (train.resume; ``restart_from``: the checkpoint an engine that
        # restarted the ranks registered), save every train.save_interval steps and at the last one
        self.checkpoints = TrainingCheckpoints(engine, loader, run_dir, cfg.save_interval, cfg.resume, cfg.keep_last,
                                               last_step=max_steps, restart_from=restart_from)
        self._saves_reported = 0  # records of checkpoint saves already sent to the monitors
        self.first_step = 1
        self.last_step_done = 0  # the last optimizer step that ended (0: none yet)
        self.preempted: dict[str, Any] | None = None  # preempted.json's record, once the ranks agreed to stop
        self.progress: TrainingProgress | None = None
        self._start = self._step_started = 0.0
        self._timers_before: Any = None

    def announce(self, model_name: str, seq_len: int) -> None:
        if self.rank == 0:
            print(f"[dsrun] training {model_name} ({self.metrics['num_params']:,} parameters) for {self.max_steps} "
                  f"steps on {self.metrics['world_size']} rank(s); {self.engine.train_batch_size()} samples x "
                  f"{seq_len} tokens per step", flush=True)
            if self.flops_meter is not None:
                print(f"[dsrun] {self.flops_meter.peak.line()}", flush=True)

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; returns the first step to train."""
        self.first_step = self.checkpoints.resume() + 1
        self.last_step_done = self.first_step - 1
        if self.rank == 0:  # a run directory used again (hydra.run.dir, a restart): an earlier stop's record goes
            (self.run_dir / PREEMPTED_JSON).unlink(missing_ok=True)
        if self.first_step > 1:
            self.metrics["resumed_from_step"] = self.first_step - 1
        self.engine.print_step_lines = False  # the progress line carries step, loss and lr
        self.progress = TrainingProgress(self.max_steps, enabled=self.rank == 0,
                                         print_every=self.engine.steps_per_print() or 1,
                                         start_step=self.first_step - 1)
        return self.first_step

    def evaluate_first(self) -> None:
        initial = self._evaluate()
        self.metrics["eval_losses"].append({"step": self.first_step - 1, "loss": initial, **self._eval_counts()})
        self.progress.note(f"[dsrun] step {self.first_step - 1}/{self.max_steps} | eval {initial:.4f}")
        self._start = time.perf_counter()

    def step_begins(self) -> None:
        self._step_started, self._timers_before = time.perf_counter(), self._timers(self.engine, None)

    def step_ends(self, step: int, loss: float) -> bool:
        """Record optimizer step ``step`` (``loss``: this rank's mean over its micro-batches); evaluate, report,
        save a checkpoint when due. Returns True when every rank agreed to stop."""
        engine, metrics = self.engine, self.metrics
        metrics["step_times_ms"].append((time.perf_counter() - self._step_started) * 1e3)
        metrics["step_timers_ms"].append(self._timers(engine, self._timers_before))
        loss = self._mean(loss)
        metrics["train_losses"].append(loss)
        metrics["lrs"].append(engine.get_lr()[0])
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {step}")
        if step % self.eval_every == 0 or step == self.max_steps:
            eval_loss = self._evaluate()
            metrics["eval_losses"].append({"step": step, "loss": eval_loss, **self._eval_counts()})
            engine.monitor.write_events([("Eval/Samples/eval_loss", eval_loss, engine.global_samples)])
        elapsed = time.perf_counter() - self._start
        samples_s, tokens_s = self._throughput(engine, step - self.first_step + 1, elapsed, self.tokens_per_step,
                                               self.step_flops)
        rate = self._flops_rate(step - self.first_step + 1, elapsed)
        evaluated = metrics["eval_losses"][-1]["step"] == step
        self.progress.update(step, loss, engine.get_lr()[0], samples_s, tokens_s, elapsed,
                             extra=f"eval {metrics['eval_losses'][-1]['loss']:.4f}" if evaluated else "",
                             tflops=rate.tflops_per_device if rate else None, mfu=rate.mfu if rate else None)
        self.last_step_done = step
        stopped_by = self._stop.agreed()
        preempted = stopped_by in PREEMPTION_SIGNALS
        if preempted:  # the record first: if the grace period ends during the save, it says where the run was
            self._record_preemption(stopped_by, step, saved=False)
        # a stopped run saves where it is if saving is on; a preempted one saves there in any case
        self.checkpoints.save_if_due(step, force=bool(stopped_by), always=preempted)
        self._report_saves()
        if preempted and self.checkpoints.last_saved_step == step:
            self._stop.settle()
            self._record_preemption(stopped_by, step, saved=True)
        saved = self.checkpoints.saved_at(step)
        # every rank decides alike: evaluations, saves and stops are agreed by all
        if self._reporter is not None and (evaluated or saved or stopped_by or step == self.max_steps):
            reported = {"step": step, "loss": loss, "lr": engine.get_lr()[0]}
            if evaluated:
                reported["eval_loss"] = metrics["eval_losses"][-1]["loss"]
            self._reporter.report(step, reported, saved)
        return bool(stopped_by)

    def _report_saves(self) -> None:
        """Each save's record to the monitors once it is published (a decoupled save's at a later step)."""
        for record in self.checkpoints.records[self._saves_reported:]:
            if not record.settled():
                break
            self.engine.monitor.write_events(record.events())
            self._saves_reported += 1

    def _record_preemption(self, signum: int, step: int, saved: bool, boundary: bool = True) -> None:
        """``preempted.json`` (rank 0): the signal, the step the ranks stopped after, whether the checkpoint there
        was saved (its tag), the grace period, and whether the ranks reached that step boundary at all."""
        tag = layout.read_latest(self.checkpoints.save_dir) if saved else None
        self.preempted = {"signal": signal.Signals(signum).name, "step": step, "saved": saved, "checkpoint": tag,
                          "grace_s": self._stop.grace_s, "reached_boundary": boundary}
        if self._stop.notice is not None:  # the engine's notice, not a signal, stopped the ranks
            self.preempted["notice"] = self._stop.notice
        if self.rank == 0:
            atomic_write_text(self.run_dir / PREEMPTED_JSON, json.dumps(self.preempted, indent=2) + "\n")

    def grace_expired(self) -> str:
        """The grace period ended before this rank saved: record where the run stood; the line that says it."""
        grace = f"train.preemption.grace_s={self._stop.grace_s:g} s"
        if self.preempted is not None:
            step = self.preempted["step"]
            self._record_preemption(signal.Signals[self.preempted["signal"]], step, saved=False)
            return (f"[dsrun] rank {self.rank}: preempted by {self.preempted['signal']}: the checkpoint at step "
                    f"{step} was not saved within {grace}; stopping without it")
        signum = self._stop.signal or signal.SIGTERM
        self._record_preemption(signum, self.last_step_done, saved=False, boundary=False)
        return (f"[dsrun] rank {self.rank}: preempted by {signal.Signals(signum).name}: step "
                f"{self.last_step_done + 1} did not end within {grace}; stopping without a checkpoint")

    def _flops_rate(self, steps: int, elapsed: float) -> FlopsRate | None:
        """The model's TFLOP/s per device and MFU over the steps run so far, sent to the monitors too."""
        rate = self.flops_meter.rate(steps, elapsed) if self.flops_meter is not None else None
        if rate is not None:
            self.engine.monitor.write_events(rate.events(self.engine.global_samples))
        return rate

    def finish(self, stopped_by: str | None, record_peak: Callable[[], None],
               extra_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the progress line, write metrics.json (rank 0) and the run's reports; returns the metrics."""
        engine, metrics = self.engine, self.metrics
        self.checkpoints.wait_for_writes()  # a decoupled save in flight: published before the run says it ended
        self._report_saves()
        metrics["checkpoint_saves"] = [record.as_metrics() for record in self.checkpoints.records]
        if stopped_by is not None:
            metrics["stopped_by_signal"] = stopped_by
        if self.preempted is not None:
            metrics["preempted"] = self.preempted
        self.progress.close()
        wall = time.perf_counter() - self._start
        steps_done = len(metrics["train_losses"])
        metrics.update(steps=steps_done, wall_time_s=wall,
                       samples_per_second=steps_done * engine.train_batch_size() / wall,
                       tokens_per_second=steps_done * self.tokens_per_step / wall,
                       final_eval_loss=metrics["eval_losses"][-1]["loss"] if metrics["eval_losses"] else None,
                       **(extra_metrics or {}))
        rate = self.flops_meter.rate(steps_done, wall) if self.flops_meter is not None and steps_done else None
        if rate is not None:
            metrics.update(tflops_per_device=rate.tflops_per_device, mfu=rate.mfu)
        record_peak()
        reports = write_run_reports(engine, self.run_dir)  # comms.json, flops_profile.txt (rank 0)
        if self.rank == 0:
            atomic_write_text(self.run_dir / METRICS_JSON, json.dumps(metrics, indent=2) + "\n")
        engine.monitor.log_artifacts([self.run_dir / RESOLVED_YAML, self.run_dir / DS_CONFIG_JSON,
                                      self.run_dir / METRICS_JSON, *reports])
        engine.monitor.close()
        return metrics
