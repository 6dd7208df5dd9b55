"""Bytes one rank's collectives carry per optimizer step, as the comms logger counts them (message bytes:
the all-gather's output, the reduce-scatter's and all-to-all's input, the all-reduce's tensor), and the
part that leaves the rank (traffic).

With ``psi`` parameters (``psi_t`` trainable, ``psi_s`` of them small enough to stay gathered at stage 3),
``e`` bytes per model element, ``g`` gradient-accumulation micro-steps and N ranks:

* stage 0: one all-reduce of the gradients per step, ``psi_t * e``.
* stages 1-2: the gradients reduce-scattered (stage 1 once per step, stage 2 every micro-step) and the
  updated parameters all-gathered once, ``psi * e``.
* stage 3: every micro-step gathers each parameter before its forward and again before its backward,
  ``2 g (psi - psi_s) * e``, the persistent ones once per step (``psi_s * e``); every micro-step
  reduce-scatters the gradients, ``g psi_t * e`` (the ZeRO paper's 3 psi against stage 0's 2 psi).
  **qwZ** sends ``1 + 4 / WEIGHT_BLOCK`` bytes per gathered element instead of ``e`` (INT8 code and a share
  of its block's fp32 scale); ``zero_quantized_nontrainable_weights`` does so for the frozen share of the
  gathered elements, ``(psi - psi_t) / psi``; **qgZ** sends ``1/2 + 4 / GRAD_BLOCK`` per gradient element through all-to-all
  (INT4), and with M > 1 nodes of L ranks a second all-to-all across nodes carries ``psi_t / L`` more.

MiCS (shard groups of S ranks, R = N / S replicas): gathers and the gradient reduction run inside the shard
group (the same message bytes, ``(S - 1) / S`` of them leave the rank; qgZ is one flat all-to-all there),
and each step all-reduces the fp32 gradient partition, ``4 psi_t / S``, across the R replicas
(``replica_bytes``). hpZ (secondary groups of H ranks): the backward gathers read the secondary partition,
so ``(H - 1) / H`` of their bytes leave the rank instead of ``(N - 1) / N``. MiCS's hierarchical gather
(``mics_hierarchical_params_gather``) is counted as one gather. ``stage3_use_all_reduce_for_fetch_params``
fetches the exactly gathered elements (not qwZ's, not the frozen INT8 share, not hpZ's secondary backward
gathers) with an all-reduce of the same message bytes, ``2 (S - 1) / S`` of which leave the rank.

Parameters are counted as one flat vector: per-parameter padding to N shards and block rounding are left
out, and so are the estimator's other approximations (a stage-3 parameter reused between forward and
backward within ``stage3_max_reuse_distance`` is gathered once, not twice).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from dsrun.comm.quantized import GRAD_BLOCK, WEIGHT_BLOCK

from .inputs import EstimateInputs

ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class CommVolume:
    """Per rank and optimizer step: message bytes of the parameter all-gathers and of the gradient
    reduction (all-reduce, reduce-scatter or qgZ's all-to-all), and the bytes leaving the rank."""

    gather_bytes: float
    gradient_bytes: float
    traffic_bytes: float
    gradient_op: str
    replica_bytes: float = 0.0  # MiCS: the all-reduce of the fp32 gradient partition across shard groups

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


def step_comm_volume(spec: EstimateInputs) -> CommVolume:
    """The comm volume of ``spec``'s run (see the module docstring)."""
    n, e, g = spec.data_parallel_size, ELEMENT_BYTES[spec.precision], spec.gradient_accumulation_steps
    psi, trainable = spec.total_params, spec.trainable
    leaving = (n - 1) / n if n > 1 else 0.0
    if n == 1:
        return CommVolume(0.0, 0.0, 0.0, "none")
    if spec.zero_stage == 0:
        size = trainable * e
        return CommVolume(0.0, size, 2 * size * leaving, "all_reduce")
    if spec.zero_stage in (1, 2):
        grads = trainable * e * (g if spec.zero_stage == 2 else 1)
        gather = psi * e
        return CommVolume(gather, grads, (grads + gather) * leaving, "reduce_scatter")
    small = min(spec.small_params, psi)
    forward = g * (psi - small) + small  # gathered before each forward (persistent ones once per step)
    backward = g * (psi - small)  # and again before each backward
    int8 = 1 + 4 / WEIGHT_BLOCK
    frozen_share = (psi - trainable) / psi if spec.buffers.zero_quantized_nontrainable_weights and psi else 0.0
    per_gathered = int8 if spec.buffers.zero_quantized_weights else e + (int8 - e) * frozen_share
    gather = (forward + backward) * per_gathered
    s, h = spec.partition_ranks, spec.hpz_ranks  # MiCS shard group (else N); hpZ secondary group (0: none)
    in_shard = (s - 1) / s
    gather_traffic = forward * per_gathered * in_shard + backward * per_gathered * ((h - 1) / h if h else in_shard)
    if spec.buffers.stage3_use_all_reduce_for_fetch_params and not spec.buffers.zero_quantized_weights:
        exact = e * (1 - frozen_share)  # bytes per fetched element an all-reduce carries: it sends them twice
        gather_traffic += (forward + (0 if h else backward)) * exact * in_shard
    replicas = n // s  # MiCS: each step all-reduces the fp32 gradient partition across the shard groups
    replica = -(-trainable // s) * 4 if replicas > 1 else 0
    replica_traffic = 2 * replica * (replicas - 1) / replicas if replicas > 1 else 0.0
    if spec.buffers.zero_quantized_gradients:
        per_grad = 0.5 + 4 / GRAD_BLOCK
        intra = g * trainable * per_grad
        two_stage = spec.nodes > 1 and s == n  # hierarchical only over the whole world (MiCS: flat)
        inter = intra / spec.ranks_per_node if two_stage else 0.0
        local = spec.ranks_per_node if two_stage else s
        traffic = gather_traffic + intra * (local - 1) / local + inter * (spec.nodes - 1) / spec.nodes
        return CommVolume(gather, intra + inter, traffic + replica_traffic, "all_to_all_single", replica)
    grads = g * trainable * e
    return CommVolume(gather, grads, gather_traffic + grads * in_shard + replica_traffic, "reduce_scatter", replica)
