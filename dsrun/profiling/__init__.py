"""Profiling: the flops profiler (:mod:`dsrun.profiling.flops_profiler`), the wall-clock breakdown
(:mod:`dsrun.profiling.wall_clock`) and model FLOPs utilisation (:mod:`dsrun.profiling.mfu`)."""
