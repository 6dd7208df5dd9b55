"""Elastic batch sizes: with ``elasticity.enabled`` the batch triad comes from the elasticity search,
not from the top-level keys (config-keys.md §3 rule 3 and §5).

The search follows DeepSpeed's published algorithm. Version 0.1: for each acceptable micro batch size
and for their least common multiple, the candidate global batch is that base times the largest highly
composite number that keeps it under ``max_train_batch_size``; the candidate valid for the most GPU counts in ``[min_gpus, max_gpus]`` wins
(ties go to the larger batch when ``prefer_larger_batch``). Version 0.2 runs the same search per node,
counting data-parallel ranks (``num_gpus_per_node // model_parallel_size`` per node), and falls back to a
batch fitted to the current world size when that size is not among the valid ones.
"""
from __future__ import annotations

import math
from typing import Any

from dsrun.utils.errors import Problem

from .batch import BatchResolution

# Highly composite numbers: each has more divisors than any smaller number, so a batch that is a
# multiple of one divides evenly among many GPU counts.
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
    15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
    498960, 554400, 665280, 720720,
)


def _candidate_batches(micro_batches: list[int], max_batch: int) -> list[int]:
    candidates = set()
    # Each micro batch size, and their least common multiple, is a base to scale.
    for micro in [*micro_batches, math.lcm(*micro_batches)]:
        if micro >= max_batch:
            candidates.add(micro)
            continue
        limit = max_batch // micro
        best = max(h for h in HIGHLY_COMPOSITE if h <= limit)
        candidates.add(best * micro)
    return sorted(candidates)


def _valid_gpu_counts(batch: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    counts: set[int] = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        most = batch // micro
        if min_gpus <= most <= max_gpus:
            counts.add(most)
        for n in range(max(1, min_gpus), min(most // 2, max_gpus) + 1):
            if most % n == 0:
                counts.add(n)
    return sorted(counts)


def _search_v01(micro_batches: list[int], max_batch: int, min_gpus: int, max_gpus: int,
                prefer_larger: bool) -> tuple[int, list[int]]:
    best_batch, best_counts = min(micro_batches), []
    for batch in _candidate_batches(micro_batches, max_batch):
        counts = _valid_gpu_counts(batch, micro_batches, min_gpus, max_gpus)
        better = len(counts) > len(best_counts)
        tie = len(counts) == len(best_counts) and (
            (prefer_larger and batch > best_batch) or (not prefer_larger and batch < best_batch))
        if better or tie:
            best_batch, best_counts = batch, counts
    return best_batch, best_counts


def _micro_for(batch: int, dp_size: int, micro_batches: list[int], prefer_larger: bool) -> int | None:
    fitting = [m for m in micro_batches if (batch // dp_size) % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def elastic_plan(el: Any, world_size: int) -> tuple[int, list[int], int | None, int]:
    """(global batch, valid data-parallel sizes, micro batch for this world, data-parallel size)."""
    micro_batches = list(el.micro_batch_sizes)
    if el.version < 0.2:
        batch, counts = _search_v01(micro_batches, el.max_train_batch_size, el.min_gpus, el.max_gpus,
                                    el.prefer_larger_batch)
        micro = None
        for m in sorted(set(micro_batches), reverse=True):
            if world_size and (batch // world_size) % m == 0:
                micro = m
                break
        return batch, counts, micro, world_size
    per_node = el.num_gpus_per_node // el.model_parallel_size
    batch, node_counts = _search_v01(micro_batches, int(el.max_train_batch_size / per_node),
                                     int(el.min_gpus / el.num_gpus_per_node), int(el.max_gpus / el.num_gpus_per_node),
                                     el.prefer_larger_batch)
    batch *= per_node
    dp_counts = [n * per_node for n in node_counts]
    dp_size = world_size // el.model_parallel_size
    if dp_size in dp_counts:
        return batch, dp_counts, _micro_for(batch, dp_size, micro_batches, el.prefer_larger_batch), dp_size
    current_dp = int((world_size / el.num_gpus_per_node) * per_node) or 1
    fitted = [math.floor(el.max_train_batch_size / float(m * current_dp)) * m * current_dp for m in micro_batches]
    batch = max(fitted) if el.prefer_larger_batch else min(fitted)
    return batch, [current_dp], _micro_for(batch, current_dp, micro_batches, el.prefer_larger_batch), current_dp


def resolve_elastic_batch(cfg: Any, raw: dict[str, Any], world_size: int, world_size_source: str,
                          prefix: str) -> tuple[BatchResolution | None, list[Problem]]:
    """The batch triad elasticity computes for ``world_size``, or the problems."""
    el = cfg.elasticity
    ep = f"{prefix}elasticity"
    if el.max_train_batch_size is None or not el.micro_batch_sizes or el.version not in (0.1, 0.2) \
            or (el.version == 0.2 and el.num_gpus_per_node % el.model_parallel_size):
        return None, []  # reported by the rules
    batch, counts, micro, dp_size = elastic_plan(el, world_size)
    where = f"world size {world_size}, from {world_size_source}"
    if dp_size not in counts or micro is None:
        return None, [Problem(
            ep, f"{where} is not compatible with the elastic batch {batch}",
            f"valid data-parallel sizes: {counts[:20]}{' ...' if len(counts) > 20 else ''}")]
    gas = batch // (micro * dp_size)
    if gas < 1 or batch != micro * gas * dp_size:
        return None, [Problem(ep, f"elastic batch {batch} does not split into micro batch {micro} x data-parallel "
                              f"size {dp_size} ({where})")]
    explanation = "\n".join([
        f"train_batch_size = {batch} (elasticity v{el.version}: best batch <= {el.max_train_batch_size} for "
        f"GPU counts {el.min_gpus}..{el.max_gpus})",
        f"train_micro_batch_size_per_gpu = {micro} (largest of {el.micro_batch_sizes} dividing {batch} // {dp_size})",
        f"gradient_accumulation_steps = {gas} (inferred: {batch} // ({micro} * {dp_size}))",
        f"{where}; data-parallel size {dp_size}; check: {micro} * {gas} * {dp_size} = {micro * gas * dp_size}",
    ])
    return BatchResolution(batch, micro, gas, explanation), []
