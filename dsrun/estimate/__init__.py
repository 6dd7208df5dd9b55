"""Memory estimation: DeepSpeed's model-state estimators and dsrun's per-rank peak estimate.

DeepSpeed-compatible (same names, signatures and printed tables as DeepSpeed 0.14.1's documentation):
``estimate_zero2_model_states_mem_needs_all_live``, ``estimate_zero2_model_states_mem_needs_all_cold``,
``estimate_zero3_model_states_mem_needs_all_live``, ``estimate_zero3_model_states_mem_needs_all_cold``.

dsrun's own estimate, pure arithmetic on numbers (so the autotuner can prune trials with it):
``estimate_peak_bytes_per_rank(EstimateInputs(...)) -> Breakdown``. See docs/estimate.md for the formulas.
"""
from __future__ import annotations

from dsrun.estimate.counting import ParameterCounts, count_parameters
from dsrun.estimate.inputs import BufferSettings, EstimateInputs, GPTShape
from dsrun.estimate.peak import Breakdown, estimate_peak_bytes_per_rank, estimate_zero_options
from dsrun.estimate.deepspeed_compat import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)

__all__ = [
    "Breakdown",
    "BufferSettings",
    "EstimateInputs",
    "GPTShape",
    "estimate_peak_bytes_per_rank",
    "estimate_zero_options",
    "ParameterCounts",
    "count_parameters",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]
