"""Profiling: the flops profiler (:mod:`dsrun.profiling.flops_profiler`) and the wall-clock breakdown
(:mod:`dsrun.profiling.wall_clock`)."""
