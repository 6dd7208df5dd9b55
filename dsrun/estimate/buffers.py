"""Communication buffers per rank: gradient reduction buckets and ZeRO-3 gathered parameters.

Sizes are DeepSpeed's element counts (``zero_optimization.*``) times the working element size ``w``, never
more than what they could hold; ``B = min(reduce_bucket_size, T)``. They follow dsrun's ZeRO strategies:

* stages 0-1 reduce in place from the flat gradient buffer, and the updated partitions are all-gathered
  straight into the flat parameter buffer: no extra memory;
* stage 2 keeps a pool of a bucket of copied gradients and the received piece, ``(B + B/N) * w``, twice
  with ``overlap_comm`` (a second bucket in flight); ``B * w`` with optimizer offload. The pool persists,
  so it is live with the activations;
* stage 3 holds gathered parameters (N > 1) while the activations are live: the largest layer plus what
  is prefetched ahead, ``min(P, max(L, min(stage3_max_live_parameters, L + stage3_prefetch_bucket_size)))
  * w``, plus the largest layer's full gradient ``L * w`` (with no prefetch: DeepSpeed's
  ``largest_layer_memory = 4 * largest_layer_params`` in fp16). Its reduction is transient: a bucket's
  full gradients and their rows for the reduce-scatter, ``2 * B * w``, plus the received shards, up to
  ``T/N * w`` with ``overlap_comm`` (they are added up only when backward ends). When the whole model fits
  in one bucket that happens once, at the end of backward, after the activations are gone; otherwise
  buckets are launched while activations are still live.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.estimate.inputs import EstimateInputs


@dataclass(frozen=True)
class BufferBytes:
    """Buffer bytes per rank: ``reduce_bucket`` (stage 2's persistent pool), ``gathered_params`` (stage 3),
    ``reduce_transient`` (stage 3's buckets while they are reduced) and whether those buckets are launched
    while activations are live (``transient_during_backward``, when the model needs more than one).
    ``backward``: what is live with the activations; ``end_of_backward``: what is live when reduction ends."""

    reduce_bucket: int
    gathered_params: int
    reduce_transient: int = 0
    transient_during_backward: bool = False

    @property
    def backward(self) -> int:
        transient = self.reduce_transient if self.transient_during_backward else 0
        return self.reduce_bucket + self.gathered_params + transient

    @property
    def end_of_backward(self) -> int:
        return self.reduce_bucket + self.gathered_params + self.reduce_transient


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
    reduce_bucket = gathered = transient = 0
    if spec.zero_stage == 2:
        received = -(-bucket // n) if spec.offload_optimizer == "none" else 0
        reduce_bucket = (bucket + received) * w * in_flight
    if spec.zero_stage == 3:
        if n > 1:  # one rank's partition is already the whole model
            gathered = stage3_gathered_elements(spec) * w + spec.largest_layer_params * w
        received = (-(-spec.trainable // n) if spec.overlap_comm else -(-bucket // n)) if n > 1 else 0
        transient = (2 * bucket + received) * w
    return BufferBytes(reduce_bucket=reduce_bucket, gathered_params=gathered, reduce_transient=transient,
                       transient_during_backward=spec.zero_stage == 3 and bucket < spec.trainable)
