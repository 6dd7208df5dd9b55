"""Elastic batch sizes: DeepSpeed's search for a global batch size that many GPU counts can train with.

With ``elasticity.enabled`` the batch triad comes from this search, not from the top-level keys
(config-keys.md §3 rule 3 and §5). The public API over it is :mod:`dsrun.elasticity`
(``compute_elastic_config``); this module holds the search itself, so the config layer can resolve batch
sizes without importing anything above it.

**Version 0.1.** The bases are the acceptable micro batch sizes and their least common multiple. Each base
is scaled by the largest highly composite number ``h`` with ``base * h <= max_train_batch_size`` (a base
at or above the maximum stays as it is). For each candidate batch ``B`` a GPU count ``g`` in
``[min_gpus, max_gpus]`` is valid when some micro batch ``m`` has ``g * m`` dividing ``B`` (so every GPU
runs whole micro batches and the gradient accumulation steps are an integer). The candidate with the most
valid counts wins; a tie goes to the larger batch with ``prefer_larger_batch`` (the smaller otherwise).
``min_gpus`` of 0 means 1 and ``max_gpus`` of 0 means ``max_train_batch_size // min(micro_batch_sizes)``.

**Version 0.2** runs the same search over *nodes*: the maximum batch is divided by the data-parallel ranks
per node (``num_gpus_per_node // model_parallel_size``), the GPU bounds by ``num_gpus_per_node``; the batch
found is multiplied back and the valid node counts become data-parallel sizes. When the current world
(``current_num_gpus // model_parallel_size``) is not among them, the batch is instead fitted to the current
data-parallel size: for each micro batch ``m`` the largest multiple of ``m * dp`` that stays within the
maximum, the largest (or smallest) of those. The micro batch version 0.2 reports is the largest (or the
first listed) ``m`` dividing ``batch // current_num_gpus``.

Where DeepSpeed's own code yields a bare exception, dsrun raises :class:`ElasticityError` with the reason
(see docs/elasticity.md for the list).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from dsrun.utils.errors import Problem

from .batch import BatchResolution
from .model import DSConfig

# Highly composite numbers: each has more divisors than any smaller number, so a batch that is a
# multiple of one divides evenly among many GPU counts. 720720 covers batches up to 720K.
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
    15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
    498960, 554400, 665280, 720720,
)
LATEST_ELASTICITY_VERSION = 0.2
SCHEDULER_CONFIG_ENV = "DEEPSPEED_ELASTICITY_CONFIG"  # the elastic section the resource scheduler used
# what DeepSpeed reads for a key the scheduler's section leaves out
SCHEDULER_DEFAULTS: dict[str, Any] = {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
                                      "version": LATEST_ELASTICITY_VERSION}


class ElasticityError(Exception):
    """Base class of every elasticity error (DeepSpeed's ``deepspeed.elasticity.config.ElasticityError``)."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled or inconsistent."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the GPU counts the elastic batch size allows."""


def candidate_batch_sizes(bases: Sequence[int], max_acceptable_batch_size: int) -> list[int]:
    """Each base scaled by the largest highly composite number that keeps it within the maximum."""
    candidates = set()
    for base in bases:
        if base >= max_acceptable_batch_size:
            candidates.add(int(base))
            continue
        limit = max_acceptable_batch_size // base
        # beyond the table's end the largest entry is used, as DeepSpeed does
        scale = max((h for h in HIGHLY_COMPOSITE if h <= limit), default=HIGHLY_COMPOSITE[-1])
        candidates.add(int(scale * base))
    return sorted(candidates)


def valid_gpus(batch_size: int, micro_batches: Sequence[int], min_valid_gpus: int, max_valid_gpus: int) -> list[int]:
    """GPU counts in ``[min_valid_gpus, max_valid_gpus]`` that split ``batch_size`` into whole micro batches."""
    counts: set[int] = set()
    for micro in micro_batches:
        if batch_size % micro:
            continue
        most = batch_size // micro
        if min_valid_gpus <= most <= max_valid_gpus:
            counts.add(most)
        # every other divisor of `most` is at most most // 2
        for gpus in range(max(1, min_valid_gpus), min(most // 2, max_valid_gpus) + 1):
            if most % gpus == 0:
                counts.add(gpus)
    return sorted(counts)


def best_candidate(candidates: Sequence[int], micro_batches: Sequence[int], min_gpus: int, max_gpus: int,
                   prefer_larger: bool) -> tuple[int, list[int]]:
    """The candidate valid for the most GPU counts; ties by size. Starts from the smallest micro batch with
    no valid count, so a search that finds nothing returns that (or the largest empty candidate)."""
    best_batch, best_counts = int(min(micro_batches)), []
    for batch in candidates:
        counts = valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        closer = batch > best_batch if prefer_larger else batch < best_batch
        if len(counts) > len(best_counts) or (len(counts) == len(best_counts) and closer):
            best_batch, best_counts = batch, counts
    return best_batch, best_counts


def compatible_gpus_v01(micro_batches: Sequence[int], max_acceptable_batch_size: int, min_gpus: int | None = None,
                        max_gpus: int | None = None, prefer_larger: bool = True) -> tuple[int, list[int]]:
    """Version 0.1: ``(global batch size, valid GPU counts)``."""
    micro_batches = [int(m) for m in micro_batches]
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    too_big = [m for m in micro_batches if m > max_acceptable_batch_size]
    if too_big:
        raise ValueError(f"micro batch sizes {too_big} exceed max_train_batch_size {max_acceptable_batch_size}; "
                         f"every micro batch must be at most the largest acceptable batch")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    return best_candidate(candidate_batch_sizes(bases, max_acceptable_batch_size), micro_batches,
                          min_gpus, max_gpus, prefer_larger)


def micro_batch_v02(batch_size: int, current_num_gpus: int, micro_batches: Sequence[int],
                    prefer_larger: bool) -> int | None:
    """Version 0.2's micro batch: the largest (or first listed) size dividing ``batch // current_num_gpus``."""
    fitting = [m for m in micro_batches if (batch_size // current_num_gpus) % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def compatible_gpus_v02(micro_batches: Sequence[int], max_acceptable_batch_size: int, current_num_gpus: int,
                        min_gpus: int | None = None, max_gpus: int | None = None, prefer_larger: bool = True,
                        num_gpus_per_node: int = 1, model_parallel_size: int = 1
                        ) -> tuple[int, list[int], int | None]:
    """Version 0.2: ``(global batch size, valid data-parallel sizes, micro batch size)``."""
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(f"elasticity v0.2: num_gpus_per_node {num_gpus_per_node} is not divisible by "
                              f"model_parallel_size {model_parallel_size}")
    micro_batches = [int(m) for m in micro_batches]
    dp_per_node = num_gpus_per_node // model_parallel_size
    # node counts; 0 (also from None) takes version 0.1's defaults
    min_nodes = int(min_gpus / num_gpus_per_node) if min_gpus else 0
    max_nodes = int(max_gpus / num_gpus_per_node) if max_gpus else 0
    node_batch, node_counts = compatible_gpus_v01(
        micro_batches, int(max_acceptable_batch_size / dp_per_node), min_nodes, max_nodes, prefer_larger=prefer_larger)
    batch = int(node_batch) * dp_per_node
    dp_sizes = [n * dp_per_node for n in node_counts]
    if current_num_gpus // model_parallel_size in dp_sizes:
        return batch, dp_sizes, micro_batch_v02(batch, current_num_gpus, micro_batches, prefer_larger)
    # the current world is not among them: fit the batch to the current data-parallel size instead
    current_dp = (current_num_gpus / num_gpus_per_node) * dp_per_node
    fitted = [math.floor(max_acceptable_batch_size / float(m * current_dp)) * m * current_dp for m in micro_batches]
    batch = int(max(fitted) if prefer_larger else min(fitted))
    return batch, [int(current_dp)], micro_batch_v02(batch, current_num_gpus, micro_batches, prefer_larger)


def largest_micro_batch(batch_size: int, world_size: int, micro_batches: Sequence[int]) -> int | None:
    """The largest acceptable micro batch dividing each rank's share ``batch_size // world_size``."""
    for micro in sorted(set(micro_batches), reverse=True):
        if (batch_size // world_size) % micro == 0:
            return micro
    return None


def search(version: float, micro_batches: Sequence[int], max_acceptable_batch_size: int, min_gpus: int,
           max_gpus: int, prefer_larger: bool, current_num_gpus: int = 0, num_gpus_per_node: int = 1,
           model_parallel_size: int = 1) -> tuple[int, list[int], int | None]:
    """``(batch, valid counts, micro batch or None)`` for either version (v0.1 has no micro batch yet)."""
    if float(version) == 0.1:
        batch, counts = compatible_gpus_v01(micro_batches, max_acceptable_batch_size, min_gpus, max_gpus,
                                            prefer_larger)
        return int(batch), counts, None
    if float(version) == 0.2:
        if current_num_gpus < 1:
            raise ElasticityConfigError("elasticity v0.2 needs the world size to compute a valid batch size")
        return compatible_gpus_v02(micro_batches, max_acceptable_batch_size, current_num_gpus, min_gpus, max_gpus,
                                   prefer_larger, num_gpus_per_node, model_parallel_size)
    raise ElasticityConfigError(f"no elastic logic for version {version}; versions 0.1 and 0.2 exist")


def _shown(counts: list[int]) -> str:
    return f"{counts[:20]}{' ...' if len(counts) > 20 else ''}"


def for_world_size(batch: int, counts: list[int], world_size: int, micro_batches: Sequence[int]) -> int:
    """The micro batch a world of ``world_size`` trains with; raises when that world size is not valid."""
    if world_size not in counts:
        raise ElasticityIncompatibleWorldSize(f"world size {world_size} is not valid for the elastic batch {batch}; "
                                              f"valid GPU counts: {_shown(counts)}")
    micro = largest_micro_batch(batch, world_size, micro_batches)
    if micro is None:  # pragma: no cover - a valid count always has a dividing micro batch
        raise ElasticityError(f"no micro batch of {list(micro_batches)} divides {batch} // {world_size}")
    return micro


def scheduler_mismatch(max_train_batch_size: int, micro_batch_sizes: list[int], version: float,
                       environ: dict[str, str] | None = None) -> str | None:
    """What differs between the elastic section in use and the one the resource scheduler saw
    (``DEEPSPEED_ELASTICITY_CONFIG``), or None (also when the scheduler published none)."""
    text = (os.environ if environ is None else environ).get(SCHEDULER_CONFIG_ENV)
    if not text:
        return None
    try:
        seen = json.loads(text)
    except json.JSONDecodeError as err:
        return f"{SCHEDULER_CONFIG_ENV} is not JSON ({err.msg})"
    if not isinstance(seen, dict):
        return f"{SCHEDULER_CONFIG_ENV} is not a JSON object"
    for key, ours in (("max_train_batch_size", max_train_batch_size), ("micro_batch_sizes", micro_batch_sizes),
                      ("version", version)):
        theirs = seen.get(key, SCHEDULER_DEFAULTS[key])
        if key == "version" and theirs is not None:
            theirs, ours = float(theirs), float(ours)
        if theirs != ours:
            return (f"the resource scheduler scaled this job for {key}={theirs!r} ({SCHEDULER_CONFIG_ENV}), "
                    f"but the config says {ours!r}")
    return None


def resolve_elastic_batch(cfg: DSConfig, raw: dict[str, Any], world_size: int, world_size_source: str,
                          prefix: str) -> tuple[BatchResolution | None, list[Problem]]:
    """The batch triad elasticity computes for ``world_size`` (as DeepSpeed's runtime does: the data-parallel
    size with an ``mpu``, else the world size), or the problems."""
    el = cfg.elasticity
    ep = f"{prefix}elasticity"
    if el.max_train_batch_size is None or not el.micro_batch_sizes or el.version not in (0.1, 0.2) \
            or (el.version == 0.2 and el.num_gpus_per_node % el.model_parallel_size) \
            or max(el.micro_batch_sizes) > el.max_train_batch_size:
        return None, []  # reported by the rules
    mismatch = scheduler_mismatch(el.max_train_batch_size, list(el.micro_batch_sizes), el.version)
    if mismatch:
        return None, [Problem(ep, mismatch, "launch with the same elasticity section the scheduler used")]
    where = f"world size {world_size}, from {world_size_source}"
    try:
        batch, counts, _ = search(el.version, el.micro_batch_sizes, el.max_train_batch_size, el.min_gpus,
                                  el.max_gpus, el.prefer_larger_batch, world_size, el.num_gpus_per_node,
                                  el.model_parallel_size)
        if world_size not in counts:
            return None, [Problem(ep, f"{where} is not valid for the elastic batch {batch}",
                                  f"valid GPU counts: {_shown(counts)}; launch on one of them or change the section")]
        micro = for_world_size(batch, counts, world_size, el.micro_batch_sizes)
    except (ElasticityError, ValueError) as err:
        return None, [Problem(ep, str(err))]
    gas = batch // (micro * world_size)
    explanation = "\n".join([
        f"train_batch_size = {batch} (elasticity v{el.version}: the batch <= {el.max_train_batch_size} valid for "
        f"the most GPU counts in {el.min_gpus}..{el.max_gpus})",
        f"train_micro_batch_size_per_gpu = {micro} (largest of {el.micro_batch_sizes} dividing {batch} // {world_size})",
        f"gradient_accumulation_steps = {gas} (inferred: {batch} // ({micro} * {world_size}))",
        f"{where}; check: {micro} * {gas} * {world_size} = {micro * gas * world_size}",
    ])
    return BatchResolution(batch, micro, gas, explanation), []
