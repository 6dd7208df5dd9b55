"""Communication buffers per rank: gradient reduction buckets, parameter all-gather, ZeRO-3 gathering.

All sizes are DeepSpeed's element counts (``zero_optimization.*``) times the working element size ``w``,
and no buffer is larger than what it could ever hold:

* gradient reduction: stages 0-1 reduce in place from the flat gradient buffer (no extra memory);
  stage 2 copies gradients into a bucket and receives its own piece, ``(B + B/N) * w`` with
  ``B = min(reduce_bucket_size, T)``; stage 3 (N > 1) uses a ``B * w`` bucket. Both double with
  ``overlap_comm`` (DeepSpeed's default at stage 3), which keeps a second bucket in flight;
* the updated partitions are all-gathered straight into the flat parameter buffer (no extra memory);
* ZeRO-3 gathered parameters (forward and backward): the largest layer plus what is prefetched ahead,
  ``min(P, max(L, min(stage3_max_live_parameters, L + stage3_prefetch_bucket_size))) * w``, plus the
  largest layer's full gradient before it is reduce-scattered, ``L * w``. With no prefetch this is
  DeepSpeed's ``largest_layer_memory = 4 * largest_layer_params`` in fp16.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.estimate.inputs import EstimateInputs


@dataclass(frozen=True)
class BufferBytes:
    """Buffer bytes per rank, live with the activations: the gradient ``reduce_bucket`` (s) and, at
    ZeRO-3, the ``gathered_params``; ``backward`` is their sum."""

    reduce_bucket: int
    gathered_params: int

    @property
    def backward(self) -> int:
        return self.reduce_bucket + self.gathered_params


def working_bytes(spec: EstimateInputs) -> int:
    return 2 if spec.mixed_precision else 4


def stage3_gathered_elements(spec: EstimateInputs) -> int:
    """Parameters ZeRO-3 holds gathered at once: the largest layer plus the prefetch, within the live cap."""
    largest = spec.largest_layer_params
    b = spec.buffers
    ahead = min(b.stage3_max_live_parameters, largest + b.stage3_prefetch_bucket_size)
    return min(spec.total_params, max(largest, ahead))


def buffer_bytes(spec: EstimateInputs) -> BufferBytes:
    """Communication buffer bytes per rank for ``spec`` (see the module docstring)."""
    w = working_bytes(spec)
    b = spec.buffers
    n = spec.world_size
    bucket = min(b.reduce_bucket_size, spec.trainable)
    in_flight = 2 if spec.overlap_comm else 1
    reduce_bucket = 0
    if spec.zero_stage == 2 and spec.offload_optimizer == "none":
        reduce_bucket = (bucket + -(-bucket // n)) * w * in_flight
    elif spec.zero_stage == 2 or (spec.zero_stage == 3 and n > 1):
        reduce_bucket = bucket * w * in_flight
    gathered = 0
    if spec.zero_stage == 3 and spec.world_size > 1:  # one rank's partition is already the whole model
        gathered = stage3_gathered_elements(spec) * w + spec.largest_layer_params * w
    return BufferBytes(reduce_bucket=reduce_bucket, gathered_params=gathered)
