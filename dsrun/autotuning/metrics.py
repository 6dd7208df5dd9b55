"""The metric of one trial, over its profile window, from what the worker recorded in its ``metrics.json``.

The worker records, per optimizer step, the engine's own ``wall_clock_breakdown`` timers (forward,
backward and step, summed over the step's micro-steps: ``step_timers_ms``) and the step's wall time
(``step_times_ms``). Over steps ``start_profile_step`` … ``end_profile_step`` (1-based, inclusive):

* ``fwd``, ``bwd``, ``step``: median milliseconds per optimizer step of each timer;
* ``latency`` = the median over the window of each step's fwd + bwd + step (DeepSpeed's ``(fwd + bwd +
  step) x gas``), in ms per optimizer step; the step's wall time when the timers were off
  (``latency_source`` says which). DeepSpeed takes a 10%-trimmed mean; the median is what such a trim
  tends to on a short window, and keeps one step that a busy machine slowed from deciding a trial;
* ``throughput`` = train_batch_size x 1000 / latency (samples/s);
* ``FLOPS_per_gpu`` = the step's analytic FLOPs (dsrun's GPT) / ranks x 1000 / latency.

As in DeepSpeed the metric leaves out data loading and evaluation, so it is higher than end-to-end throughput.
"""
from __future__ import annotations

from statistics import median
from typing import Any, Mapping

METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "flops": "FLOPS_per_gpu"}


class ProfileError(ValueError):
    """The run did not record what the metric needs."""


def profile_metrics(worker: Mapping[str, Any], start: int, end: int) -> dict[str, Any]:
    """DeepSpeed's autotuning metrics (see the module docstring) from a worker's ``metrics.json``."""
    times = list(worker.get("step_times_ms") or [])
    first = int(worker.get("resumed_from_step") or 0) + 1
    window = range(start - first, end - first + 1)
    if not times or window.start < 0 or window.stop > len(times):
        raise ProfileError(f"the run recorded {len(times)} step(s); the profile window is steps {start}..{end}")
    timers = [worker["step_timers_ms"][i] for i in window
              if i < len(worker.get("step_timers_ms") or []) and worker["step_timers_ms"][i]]
    result: dict[str, Any] = {"profile_steps": [start, end]}
    if len(timers) == len(window):
        for short, name in (("fwd", "forward"), ("bwd", "backward"), ("step", "step")):
            result[short] = median(t[name] for t in timers)
        latency = median(t["forward"] + t["backward"] + t["step"] for t in timers)
        result["latency_source"] = "engine timers (forward + backward + step)"
    else:
        latency = median(times[i] for i in window)
        result["latency_source"] = "step wall time (wall_clock_breakdown was off)"
    if latency <= 0:
        raise ProfileError(f"measured a latency of {latency} ms")
    world = int(worker.get("world_size") or 1)
    result["latency"] = latency
    result["throughput"] = int(worker["train_batch_size"]) * 1000.0 / latency
    flops = worker.get("step_flops")
    result["FLOPS_per_gpu"] = flops / world * 1000.0 / latency if flops else None
    result["step_latencies_ms"] = [times[i] for i in window]
    for key in ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps", "world_size"):
        result[key] = worker.get(key)
    return result


def metric_value(profile: Mapping[str, Any], metric: str) -> float:
    value = profile.get(METRIC_KEYS[metric])
    if value is None:
        raise ProfileError(f"metric {metric!r} is not available for this model (no analytic FLOPs count; "
                           "use throughput or latency)")
    return float(value)
