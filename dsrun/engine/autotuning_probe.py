"""``autotuning.metric_path``: an autotuning experiment times itself and stops, as DeepSpeed's engine does.

With ``autotuning.enabled`` and ``autotuning.metric_path`` both set (the tuner writes them into every
experiment's config: ``dsrun launch --autotuning tune``, docs/autotuning.md), the engine records each optimizer
step's wall time and its forward, backward and step timer totals (``wall_clock_breakdown``) up to
``end_profile_step``; after that step rank 0 writes them to ``metric_path`` (JSON: ``step_times_ms``,
``step_timers_ms``, the batch sizes and the world size, the form :func:`dsrun.autotuning.profile_metrics`
reads) and every rank exits with status 0. The tuner turns the window ``start_profile_step`` ..
``end_profile_step`` into DeepSpeed's ``latency`` / ``throughput`` / ``FLOPS_per_gpu`` (one definition,
docs/autotuning.md "What a trial is").

Without ``metric_path`` the engine trains on: DeepSpeed stops whenever ``autotuning.enabled`` is set, dsrun
only when the config also says where the measurement goes, so that a tuning recipe (``enabled: true``) still
trains with ``dsrun train``.

With ``autotuning.enabled`` and ``autotuning.model_info.profile`` the engine only profiles the model, as
DeepSpeed's does: the first forward runs under :class:`~dsrun.profiling.tensor_memory.SavedTensorBytes` (the
bytes autograd keeps for backward, exact on any device, where DeepSpeed reads the CUDA allocator), and when
backward starts rank 0 writes ``num_params``, ``trainable_num_params`` (the model's, times the model-parallel
size), ``activation_mem_per_gpu`` and ``rank`` as JSON to ``autotuning.model_info_path`` (default
``./autotuning_model_info.json``) and every rank exits with status 0.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TIMERS = ("forward", "backward", "step")


class AutotuningProbe:
    def __init__(self, engine: Any, config: Any):
        section = config.autotuning
        self.engine = engine
        # model_info.profile: the first forward's activation bytes, then the model facts and exit
        self.profile_model = bool(section.enabled and section.model_info and section.model_info.profile)
        self.model_info_path = Path(section.model_info_path or Path.cwd() / "autotuning_model_info.json")
        self._saved: Any = None
        path = section.metric_path
        self.active = bool(section.enabled and path)
        self.path = Path(path) if self.active else None
        self.end = int(section.end_profile_step)
        self.step_times_ms: list[float] = []
        self.step_timers_ms: list[dict[str, float] | None] = []
        self._last = time.perf_counter()
        self._totals = {name: 0.0 for name in TIMERS}

    def before_forward(self) -> None:
        if self.profile_model and self._saved is None:
            from dsrun.profiling.tensor_memory import SavedTensorBytes

            self._saved = SavedTensorBytes(exclude=self.engine.module.parameters())
            self._saved.__enter__()

    def before_backward(self) -> None:
        """Model-info profiling: write the model's facts with the first forward's activation bytes and exit."""
        if self._saved is None:
            return
        from dsrun import comm

        engine = self.engine
        self._saved.__exit__(None, None, None)
        params = list(engine.module.parameters())
        count = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # a ZeRO-3 shard counts whole
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
        if engine.global_rank == 0:
            mp = engine.mp_world_size
            info = {"num_params": count * mp, "trainable_num_params": trainable * mp,
                    "activation_mem_per_gpu": self._saved.bytes, "rank": engine.global_rank}
            self.model_info_path.parent.mkdir(parents=True, exist_ok=True)
            self.model_info_path.write_text(json.dumps(info) + "\n")
            print(f"[dsrun] autotuning: model info written to {self.model_info_path}; exiting", flush=True)
        if comm.is_initialized() and engine.world_size > 1:
            comm.barrier()
        sys.exit(0)

    def after_step(self, boundary: bool) -> None:
        """Called at the end of ``engine.step()``, before the wall-clock means are printed (and reset)."""
        if not self.active or not boundary:
            return
        engine, now = self.engine, time.perf_counter()
        self.step_times_ms.append((now - self._last) * 1e3)
        self._last = now
        if engine.timers.enabled:
            totals = {name: engine.timers.lifetime_ms(name) for name in TIMERS}
            delta = {name: totals[name] - self._totals[name] for name in TIMERS}
            self._totals = totals
            # an engine whose forward/backward do not go through the timers (the pipeline's schedule): wall time
            self.step_timers_ms.append(delta if delta["forward"] + delta["backward"] > 0 else None)
        else:
            self.step_timers_ms.append(None)
        if engine.global_steps >= self.end:
            self._finish()

    def _finish(self) -> None:
        from dsrun import comm

        engine = self.engine
        if engine.global_rank == 0:
            record = {"step_times_ms": self.step_times_ms, "step_timers_ms": self.step_timers_ms,
                      "train_batch_size": engine.train_batch_size(),
                      "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                      "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                      "world_size": engine.world_size, "resumed_from_step": 0, "source": "engine"}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.partial")
            partial.write_text(json.dumps(record, indent=2) + "\n")
            os.replace(partial, self.path)
            print(f"[dsrun] autotuning: measured {len(self.step_times_ms)} step(s), wrote {self.path}; exiting",
                  flush=True)
        if comm.is_initialized() and engine.world_size > 1:
            comm.barrier()
        sys.exit(0)
