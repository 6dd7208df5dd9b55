"""How far a dsrun training run may be from its reference, derived from the arithmetic, not from what one
machine printed (issue 18).

The derivation. A run of ``T`` optimizer steps in fp32 is one of many equally valid ways to round the same
computation: splitting the batch into micro-batches, summing in another order, reducing across ranks in
buckets all change which roundings happen, never the mathematics. How far such a run lands from the exact
result is not a constant: it depends on the model's conditioning and on the machine (FMA or not, the vector
width and summation order of its BLAS), and Adam amplifies it (an element whose true gradient is ~0 moves by
+-lr on the sign of its rounding noise). So the scale is *measured on the reference itself*, on the machine
running the test:

* ``wide``: the reference run in a wider precision (float64 for an fp32 run; fp32 for a bf16/fp16 run),
  a stand-in for the exact result;
* ``spread``: the largest distance from ``wide`` among the reference run in the tested precision computed
  in ``ORDERINGS`` valid ways (the whole batch at once and accumulated over 1-sample micro-batches, each in
  both sample orders): how far an fp32 (or bf16) computation of this run can land on this machine.

dsrun's run is another valid ordering, not one of those; it must land no further from ``wide`` than ``K``
times ``spread``. Compared with the reference (as the tests do), the triangle inequality gives the bound
``(K + 1) * spread``; two dsrun runs compared with each other: ``2 * K * spread``. ``K = 4``: the orderings
bracket the spread (observed: dsrun's distance is 0.4-1.1x the largest of the ensemble, ZeRO 0-3, 1-2
ranks), and 4x leaves room for an ordering outside the ensemble while staying orders of magnitude below
what a real defect does (a missing 1/N, a stale or double-counted gradient: relative errors of 1e-2 and up).

A floor keeps a bound from reaching zero: a loss is a mean of ``n`` positive terms, summed in fp32 at least
(the models compute their loss in fp32 under bf16/fp16), which two summation orders can round differently by
up to ``log2(n)`` units of rounding each (pairwise summation; the terms' sum bounds the error), so
``2 * log2(n) * eps`` relative, ``eps`` = 2**-24 the fp32 unit roundoff.

Mixed precision (bf16, fp16) is compared with the fp32 reference itself, which is its ``wide`` run: the bound
is ``K * spread`` (:meth:`Spread.to_wide`), the spread measured over PyTorch's own mixed-precision runs (the
model in bf16/fp16, fp32 master weights, as the engine does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

K = 4
EPS32 = 2.0 ** -24
WIDER = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}
# (micro-batches per batch: 1 = the whole batch, 0 = one sample each; samples in reversed order)
ORDERINGS = [(parts, reverse) for parts in (1, 0) for reverse in (False, True)]

# reference(dtype, parts, reverse) -> {"losses": [...], "params": array, "norms": [...]}
Reference = Callable[[torch.dtype, int, bool], dict[str, Any]]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def param_distance(a: Any, b: Any) -> float:
    """The largest parameter difference relative to the largest parameter (both as float64)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@dataclass(frozen=True)
class Spread:
    """How far runs of the reference in valid orderings land from the wide run (see the module docstring)."""

    wide: dict[str, Any]
    reference: dict[str, Any]  # the run in the tested precision, whole batches in order: what tests compare with
    loss: float
    params: float
    norms: float
    floor: float

    def to_reference(self, what: str) -> float:
        """Bound on a dsrun run's relative distance from the reference run for ``what`` (loss, params, norms)."""
        return (K + 1) * getattr(self, what) + self.floor

    def to_wide(self, what: str) -> float:
        """Bound on a dsrun run's relative distance from the wide run (mixed precision against fp32)."""
        return K * getattr(self, what) + self.floor

    def between_runs(self, what: str) -> float:
        """Bound on the relative distance between two dsrun runs of the same computation."""
        return 2 * (K * getattr(self, what) + self.floor)


def spread(reference: Reference, dtype: torch.dtype, n_terms: int) -> Spread:
    """Run ``reference`` wide and in every ordering; ``n_terms`` is the number of terms a loss averages."""
    wide = reference(WIDER[dtype], 1, False)
    losses, params, norms, runs = [], [], [], []
    for parts, reverse in ORDERINGS:
        run = reference(dtype, parts, reverse)
        runs.append(run)
        losses.append(max(rel(a, b) for a, b in zip(run["losses"], wide["losses"])))
        params.append(param_distance(run["params"], wide["params"]))
        norms.append(max((rel(a, b) for a, b in zip(run.get("norms") or [], wide.get("norms") or [])), default=0.0))
    floor = 2 * math.log2(max(2, n_terms)) * EPS32
    return Spread(wide, runs[0], max(losses), max(params), max(norms), floor)


def assert_tracks(got: dict[str, Any], ref: dict[str, Any], s: Spread, label: str, against: str = "reference",
                  what: tuple[str, ...] = ("losses", "params")) -> None:
    """Every step's loss (and the norms, the final parameters) of ``got`` within the derived bound of ``ref``;
    ``against``: "reference" (ref is the reference run), "wide" (ref is the wide run) or "run" (another dsrun
    run)."""
    bound = {"reference": s.to_reference, "wide": s.to_wide, "run": s.between_runs}[against]
    if "losses" in what:
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert rel(a, b) <= bound("loss"), f"{label} step {step}: loss {a} vs {b} (bound {bound('loss'):.2e})"
    if "norms" in what:
        for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
            assert rel(a, b) <= bound("norms"), f"{label} step {step}: norm {a} vs {b} (bound {bound('norms'):.2e})"
    if "params" in what:
        distance = param_distance(got["params"], ref["params"])
        assert distance <= bound("params"), f"{label}: final parameters {distance:.2e} apart (bound {bound('params'):.2e})"


def elementwise_bound(steps: int, roundings_per_step: int = 4) -> float:
    """Bound on ``max |ours - ref| / max |ref|`` for two correct implementations of an elementwise optimizer
    (a compiled SIMD kernel and torch's, or torch's fallback) after ``steps`` steps on the same gradients.

    Each step, each parameter goes through a few roundings the two may do differently (the weight decay
    multiply, the update's division, the final subtraction, an FMA fused or not): at most one unit of
    rounding of the parameter's magnitude each; the update itself is lr-sized, so its own few-ulp relative
    error adds far less. Over ``steps`` steps these add up: ``steps * roundings_per_step * eps``. (Lion's sign
    is exact except within rounding of zero, which random gradients do not hit.)"""
    return steps * roundings_per_step * EPS32


def fp32_sum_bound(n_terms: int, magnitude: float) -> float:
    """Two sums of the same ``n_terms`` fp32 values in different orders, whose absolute values add to
    ``magnitude``, differ by at most twice ``(n - 1) u sum|x|`` (``u`` = 2**-24); plus 1e-7 for one final
    rounding (an SGD step's ``w - g``). The MoE tests' bound: expert parallelism against one rank holding every
    expert."""
    u = 2.0 ** -24
    return 2 * max(1, n_terms - 1) * u * magnitude + 1e-7
