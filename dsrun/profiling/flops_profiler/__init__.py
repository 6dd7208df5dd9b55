"""DeepSpeed's flops profiler: ``FlopsProfiler(model)`` and ``get_model_profile(model, ...)``."""
from .formatting import (duration_to_string, flops_to_string, macs_to_string, number_to_string,
                         params_to_string)
from .profiler import FlopsProfiler, ModuleProfile, get_model_profile

__all__ = ["FlopsProfiler", "ModuleProfile", "get_model_profile", "duration_to_string", "flops_to_string",
           "macs_to_string", "number_to_string", "params_to_string"]
