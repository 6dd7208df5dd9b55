"""Communication buffers per rank: gradient reduction buckets, parameter all-gather, ZeRO-3 gathering.

All sizes are DeepSpeed's element counts (``zero_optimization.*``) times the working element size ``w``,
and no buffer is larger than what it could ever hold:

* gradient reduction (every stage, during backward): ``min(reduce_bucket_size, T) * w``, twice when
  ``overlap_comm`` double-buffers it (DeepSpeed's default at stage 3);
* parameter all-gather after the step (stages 1-2): ``min(allgather_bucket_size, P) * w``;
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
    """Buffer bytes per rank: ``backward`` (live with the activations), ``step`` (live during the
    optimizer step), ``gathered_params`` (ZeRO-3, live with the activations; part of neither above)."""

    reduce_bucket: int
    allgather_bucket: int
    gathered_params: int

    @property
    def backward(self) -> int:
        return self.reduce_bucket + self.gathered_params

    @property
    def step(self) -> int:
        return self.allgather_bucket


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
    reduce_bucket = min(b.reduce_bucket_size, spec.trainable) * w * (2 if spec.overlap_comm else 1)
    if spec.world_size == 1:
        reduce_bucket = 0  # nothing to reduce with one rank
    allgather = 0
    gathered = 0
    if spec.zero_stage in (1, 2) and spec.world_size > 1:
        allgather = min(b.allgather_bucket_size, spec.total_params) * w
    if spec.zero_stage == 3 and spec.world_size > 1:  # one rank's partition is already the whole model
        gathered = stage3_gathered_elements(spec) * w + spec.largest_layer_params * w
    return BufferBytes(reduce_bucket=reduce_bucket, allgather_bucket=allgather, gathered_params=gathered)
