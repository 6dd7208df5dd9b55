"""What the engine reports about itself: monitor events, the wall-clock breakdown and the flops profile.

The engine calls a handful of hooks (``before_forward`` … ``after_step``); everything observability needs
lives here, so the engine's own code stays about training. Events use DeepSpeed's names and its x-axis,
``global_samples``:

* every optimizer step: ``Train/Samples/train_loss`` (the step's loss on rank 0: the sum of the
  accumulation-scaled micro-batch losses), ``Train/Samples/lr``, and with fp16 ``Train/Samples/loss_scale``;
* every ``steps_per_print`` steps with ``wall_clock_breakdown``: ``Train/Samples/elapsed_time_ms_<timer>``
  for forward, backward, backward_inner, backward_allreduce and step, averaged over those steps (also
  printed on rank 0);
* with ``flops_profiler``: the first micro-batch of the step where ``global_steps == profile_step`` is
  profiled on rank 0, and the report is printed at the end of that step (or written to ``output_file``);
  its text stays in :attr:`EngineObserver.flops_report`;
* once the model's FLOPs per sample are known (``engine.set_model_flops``, :mod:`dsrun.profiling.mfu`):
  every ``steps_per_print`` steps (unset: every step) ``Train/Samples/tflops_per_device`` and
  ``Train/Samples/mfu`` over the steps since the last report, and the same on the engine's step line;
* with ``memory_breakdown``: DeepSpeed's memory lines (``see_memory_usage``: allocated and peak device memory,
  host memory in use) on rank 0 once the engine is built and before and after every forward, backward and
  step, labelled as DeepSpeed labels them (``Engine before forward`` ...);
* with NVMe offload (ZeRO-Infinity), every optimizer step: ``Train/Samples/nvme_read_bytes`` and
  ``Train/Samples/nvme_written_bytes``, this rank's bytes through its swap files since the last step
  (:mod:`dsrun.zero.swap_traffic`; :attr:`EngineObserver.last_swap_io` keeps the last step's);
* with ``dump_state``: once the engine is built, rank 0 logs every attribute of the engine with its value
  (DeepSpeed's ``print_configuration(engine, "DeepSpeedEngine")``).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from dsrun.monitor import MonitorMaster
from dsrun.profiling.flops_profiler import FlopsProfiler
from dsrun.profiling.memory_usage import see_memory_usage
from dsrun.profiling.mfu import DevicePeak, FlopsRate, ModelFlopsMeter, device_peak
from dsrun.profiling.wall_clock import BREAKDOWN_TIMERS, breakdown_events, breakdown_line
from dsrun.offload.swap_store import SwapIO
from dsrun.zero.swap_traffic import SwapTraffic


class EngineObserver:
    def __init__(self, engine: Any, config: Any):
        self.engine = engine
        self.config = config
        self.monitor = MonitorMaster(config, rank=engine.global_rank)
        profiler_cfg = config.flops_profiler
        self.flops_profiler: FlopsProfiler | None = None
        if profiler_cfg.enabled and engine.global_rank == 0:
            self.flops_profiler = FlopsProfiler(engine.module, ds_engine=engine,
                                                recompute_fwd_factor=profiler_cfg.recompute_fwd_factor)
            self.flops_profiler.count_outside_modules = False
        self.flops_report: str | None = None
        self.memory_breakdown = bool(config.memory_breakdown)  # see_memory_usage at every hook below
        self._profile_phase: str | None = None  # None → "forward" → "backward" → "step" → done
        self._started = 0.0
        self._loss_sum: torch.Tensor | None = None
        # MFU (set_model_flops): the meter counts samples; the window since the last report, its rate cached
        # for the step (the step line and the monitors both read it)
        self.flops_meter: ModelFlopsMeter | None = None
        self._window = (0.0, 0)  # (time, global_samples) at the window's start
        self._rate: tuple[int, FlopsRate | None] = (-1, None)  # (global_steps, the rate then)
        self.swap_traffic = SwapTraffic(engine.strategy)
        self.last_swap_io: SwapIO | None = None  # NVMe bytes of the last optimizer step (None: no NVMe offload)

    def set_model_flops(self, flops_per_sample: float, peak: DevicePeak | None = None) -> DevicePeak:
        """Count ``flops_per_sample`` model FLOPs (forward + backward, no recompute) per trained sample from now
        on; ``peak`` (one device's) defaults to the table's for a known GPU or the matmul probe's, which every
        rank calling this runs at once. Rank 0 prints the peak once. Returns the peak."""
        engine = self.engine
        peak = peak or device_peak(engine.device, engine.precision.model_dtype)
        self.flops_meter = ModelFlopsMeter(float(flops_per_sample), peak, engine.world_size)
        self._window, self._rate = (time.perf_counter(), engine.global_samples), (-1, None)
        if engine.global_rank == 0:
            print(f"[dsrun] {peak.line()}", flush=True)
        return peak

    def flops_rate(self) -> FlopsRate | None:
        """The model's TFLOP/s per device and MFU over the samples trained since the previous report; None
        before ``set_model_flops``. Calls within one optimizer step share one window."""
        engine = self.engine
        if self.flops_meter is None:
            return None
        if self._rate[0] != engine.global_steps:
            now = time.perf_counter()
            started, samples = self._window
            self._rate = (engine.global_steps, self.flops_meter.rate(engine.global_samples - samples, now - started))
            self._window = (now, engine.global_samples)
        return self._rate[1]

    # --- hooks the engine calls -----------------------------------------------------------------------
    def engine_built(self) -> None:
        """The end of the engine's construction: the memory line, and with ``dump_state`` the engine's state."""
        see_memory_usage("DeepSpeed Engine: After configure distributed model", force=self.memory_breakdown)
        if self.config.dump_state and self.engine.global_rank == 0:
            from dsrun.utils.logging import print_configuration

            print_configuration(self.engine, "DeepSpeedEngine")

    def before_forward(self) -> None:
        see_memory_usage("Engine before forward", force=self.memory_breakdown)
        prof = self.flops_profiler
        at_profile_step = self.engine.global_steps == self.config.flops_profiler.profile_step
        if (prof is not None and self._profile_phase is None and self.flops_report is None
                and self.engine.module.training and at_profile_step):
            prof.start_profile()
            self._profile_phase = "forward"
            self._started = time.perf_counter()

    def after_forward(self) -> None:
        see_memory_usage("Engine after forward", force=self.memory_breakdown)
        if self._profile_phase == "forward":
            self.flops_profiler.fwd_latency = time.perf_counter() - self._started
            self.flops_profiler.stop_profile()  # the counts stay; nothing more is counted
            self._profile_phase = "backward"

    def before_backward(self) -> None:
        see_memory_usage("Engine before backward", force=self.memory_breakdown)
        if self._profile_phase == "backward":
            self._started = time.perf_counter()

    def after_backward(self, loss: torch.Tensor) -> None:
        see_memory_usage("Engine after backward", force=self.memory_breakdown)
        if self.monitor.enabled:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        if self._profile_phase == "backward":
            self.flops_profiler.bwd_latency = time.perf_counter() - self._started
            self._profile_phase = "step"

    def before_step(self) -> None:
        see_memory_usage("Engine before step", force=self.memory_breakdown)
        if self._profile_phase == "step":
            self._started = time.perf_counter()

    def after_step(self, boundary: bool) -> None:
        """Called at the end of ``engine.step()``; ``boundary`` says whether the optimizer stepped."""
        see_memory_usage("Engine after step", force=self.memory_breakdown)
        if not boundary:
            return
        engine = self.engine
        if self._profile_phase == "step":
            self._finish_profile(time.perf_counter() - self._started)
        if self.swap_traffic.active:
            self.last_swap_io = self.swap_traffic.step()
        if self.monitor.enabled:
            lrs = engine.get_lr()
            events = [("Train/Samples/lr", float(lrs[0]), engine.global_samples)] if lrs else []
            if self._loss_sum is not None:
                events.insert(0, ("Train/Samples/train_loss", float(self._loss_sum.item()), engine.global_samples))
            if engine.fp16_enabled():
                events.append(("Train/Samples/loss_scale", float(engine.cur_scale), engine.global_samples))
            events += [(f"Train/Features/{name}", value, engine.global_samples)  # dsrun/features.py
                       for name, value in engine.features.metrics().items()]
            if self.last_swap_io is not None:
                events += [("Train/Samples/nvme_read_bytes", float(self.last_swap_io.read_bytes), engine.global_samples),
                           ("Train/Samples/nvme_written_bytes", float(self.last_swap_io.written_bytes),
                            engine.global_samples)]
            self.monitor.write_events(events)
        self._loss_sum = None
        every = engine.steps_per_print() or 1  # None: every step, as DeepSpeed 0.19 logs its timers
        rate = self.flops_rate() if self.monitor.enabled and engine.global_steps % every == 0 else None
        if rate is not None:
            self.monitor.write_events(rate.events(engine.global_samples))
        if engine.timers.enabled and engine.global_steps % every == 0:
            means = engine.timers.mean_ms()
            if engine.global_rank == 0:
                print(f"[dsrun] {breakdown_line(means, engine.global_rank)}", flush=True)
            self.monitor.write_events(breakdown_events(means, engine.global_samples))
            engine.timers.reset()

    def _finish_profile(self, step_latency: float) -> None:
        prof = self.flops_profiler
        cfg = self.config.flops_profiler
        prof.step_latency = step_latency
        self.flops_report = prof.print_model_profile(profile_step=cfg.profile_step, module_depth=cfg.module_depth,
                                                     top_modules=cfg.top_modules, detailed=cfg.detailed,
                                                     output_file=cfg.output_file)
        self.monitor.write_events([("Train/Samples/fwd_flops_per_gpu", float(prof.get_total_flops()),
                                    self.engine.global_samples)])
        prof.end_profile()
        self._profile_phase = None

    def close(self) -> None:
        """Flush and close the monitors (the worker calls it at the end of training)."""
        self.monitor.close()


__all__ = ["EngineObserver", "BREAKDOWN_TIMERS"]


COMMS_JSON = "comms.json"
FLOPS_REPORT = "flops_profile.txt"


def write_run_reports(engine: Any, run_dir: Any) -> list[Any]:
    """End of a ``dsrun train`` run; every rank must call it. Prints DeepSpeed's comms summary on rank 0
    when ``comms_logger`` is enabled; rank 0 writes ``comms.json`` (every collective that went through
    :mod:`dsrun.comm` in this process, see :func:`dsrun.comm.comms_report`) and ``flops_profile.txt`` (when
    a profile was taken) into ``run_dir``, sends the per-op totals to the monitors as
    ``Comms/<op>/count|message_bytes|total_latency_ms`` and returns the paths written."""
    import json
    from pathlib import Path

    from dsrun import comm

    if engine._config.comms_logger.enabled:
        comm.log_summary()
    report = comm.comms_report()
    if engine.global_rank != 0:
        return []
    run_dir = Path(run_dir)
    paths = [run_dir / COMMS_JSON]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    step = engine.global_samples
    events = []
    for op, entry in report["ops"].items():
        latency = sum(row["total_latency_ms"] for row in entry["sizes"])
        events += [(f"Comms/{op}/count", entry["count"], step),
                   (f"Comms/{op}/message_bytes", entry["message_bytes"], step),
                   (f"Comms/{op}/total_latency_ms", latency, step)]
    engine.monitor.write_events(events)
    if engine.observer.flops_report:
        paths.append(run_dir / FLOPS_REPORT)
        paths[-1].write_text(engine.observer.flops_report)
    return paths
