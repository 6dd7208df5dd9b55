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
  of its block's fp32 scale); **qgZ** sends ``1/2 + 4 / GRAD_BLOCK`` per gradient element through all-to-all
  (INT4), and with M > 1 nodes of L ranks a second all-to-all across nodes carries ``psi_t / L`` more.

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

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


def step_comm_volume(spec: EstimateInputs) -> CommVolume:
    """The comm volume of ``spec``'s run (see the module docstring)."""
    n, e, g = spec.world_size, ELEMENT_BYTES[spec.precision], spec.gradient_accumulation_steps
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
    gathered_elements = 2 * g * (psi - small) + small
    per_gathered = (1 + 4 / WEIGHT_BLOCK) if spec.buffers.zero_quantized_weights else e
    gather = gathered_elements * per_gathered
    if spec.buffers.zero_quantized_gradients:
        per_grad = 0.5 + 4 / GRAD_BLOCK
        intra = g * trainable * per_grad
        inter = intra / spec.ranks_per_node if spec.nodes > 1 else 0.0
        local = spec.ranks_per_node if spec.nodes > 1 else n
        traffic = gather * leaving + intra * (local - 1) / local + inter * (spec.nodes - 1) / max(1, spec.nodes)
        return CommVolume(gather, intra + inter, traffic, "all_to_all_single")
    grads = g * trainable * e
    return CommVolume(gather, grads, (gather + grads) * leaving, "reduce_scatter")
