"""An independent statement of DeepSpeed's elastic batch search, written from its definition for the tests.

It shares no code with ``dsrun.config.elastic``: highly composite numbers come from a divisor-count sieve,
and a GPU count ``g`` is valid for a batch ``B`` exactly when ``g * m`` divides ``B`` for some acceptable
micro batch ``m``, checked over the divisors of ``B``; version 0.2's fallback uses exact fractions.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def divisor_counts(n: int) -> np.ndarray:
    """``counts[k]`` = number of divisors of k: each d adds one to its multiples. Small d walk their multiples;
    for large d (> sqrt n) the loop runs over the multiplier instead, so both loops are short."""
    counts = np.zeros(n + 1, dtype=np.int64)
    root = math.isqrt(n)
    for d in range(1, root + 1):
        counts[d::d] += 1
    for multiplier in range(1, n // (root + 1) + 1):
        counts[multiplier * np.arange(root + 1, n // multiplier + 1)] += 1
    return counts


def highly_composite_upto(n: int) -> list[int]:
    """Every k <= n with more divisors than any smaller positive number."""
    counts = divisor_counts(n)
    record_before = np.maximum.accumulate(counts)[:-1]  # the most divisors among 0..k-1
    return [int(k) for k in np.flatnonzero(counts[1:] > record_before[0:]) + 1]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def valid_counts(batch: int, micro: list[int], low: int, high: int) -> list[int]:
    return [g for g in divisors(batch) if low <= g <= high and any(batch % (g * m) == 0 for m in micro)]


def v01(micro: list[int], max_batch: int, min_gpus: int | None, max_gpus: int | None, prefer_larger: bool,
        hcn: list[int]) -> tuple[int, list[int]]:
    low = min_gpus or 1
    high = max_gpus or max_batch // min(micro)
    bases = micro + [math.lcm(*micro)]
    candidates = set()
    for base in bases:
        candidates.add(base if base >= max_batch else base * max(h for h in hcn if base * h <= max_batch))
    scored = {b: valid_counts(b, micro, low, high) for b in candidates}
    best = max(candidates, key=lambda b: (len(scored[b]), b if prefer_larger else -b))
    if scored[best]:
        return best, scored[best]
    # nothing valid anywhere: the search never leaves its start (the smallest micro batch), unless it prefers
    # larger batches and some candidate is larger
    largest = max(candidates)
    return (largest if prefer_larger and largest > min(micro) else min(micro)), []


def pick_v02(batch: int, current: int, micro: list[int], prefer_larger: bool) -> int | None:
    fitting = [m for m in micro if (batch // current) % m == 0]
    return (max(fitting) if prefer_larger else fitting[0]) if fitting else None


def v02(micro: list[int], max_batch: int, current: int, min_gpus: int, max_gpus: int, prefer_larger: bool,
        per_node: int, mp: int, hcn: list[int]) -> tuple[int, list[int], int | None]:
    dp_per_node = per_node // mp
    node_batch, nodes = v01(micro, max_batch // dp_per_node, min_gpus // per_node, max_gpus // per_node,
                            prefer_larger, hcn)
    batch = node_batch * dp_per_node
    dp_sizes = [n * dp_per_node for n in nodes]
    if current // mp in dp_sizes:
        return batch, dp_sizes, pick_v02(batch, current, micro, prefer_larger)
    dp = Fraction(current, per_node) * dp_per_node
    fitted = [math.floor(Fraction(max_batch) / (m * dp)) * m * dp for m in micro]
    batch = int(max(fitted) if prefer_larger else min(fitted))
    return batch, [int(dp)], pick_v02(batch, current, micro, prefer_larger)
