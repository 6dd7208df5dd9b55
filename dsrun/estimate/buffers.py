"""Communication buffers per rank: gradient reduction buckets, ZeRO-3 gathered parameters, and the
temporaries gloo's collectives allocate.

Sizes are DeepSpeed's element counts (``zero_optimization.*``) times the working element size ``w``, never
more than what they could hold; ``B = min(reduce_bucket_size, T)``, ``K = ceil(T / B)`` buckets. They
follow dsrun's ZeRO strategies:

* stages 0-1 reduce in place from the flat gradient buffer, and the updated partitions are all-gathered
  straight into the flat parameter buffer: no buffers of their own;
* stage 2 keeps a pool of a bucket of copied gradients and the received piece, ``(B + B/N) * w``, twice
  when ``overlap_comm`` has a second bucket in flight (K > 1); ``B * w`` with optimizer offload. The pool
  persists from the first backward on, so it is live in every later phase. Parameters kept fp32
  (``data_types.keep_in_fp32_modules``, ``Kt`` trainable elements) fill fp32 buckets of their own: ``B`` is then
  ``min(reduce_bucket_size, T - Kt)`` and the pool holds ``(Bk + Bk/N) * 4`` more, ``Bk = min(reduce_bucket_size,
  Kt)`` (elsewhere kept gradients are counted as the others are, at ``w``);
* stage 3 on the CPU keeps released gather buffers for reuse (N > 1), up to one module's gathered
  (non-persistent) parameters, ``min(P - small, L) * w``, in every phase (counted with the pool above); the
  gathered parameters take their buffers out of it;
* stage 3 holds gathered parameters (N > 1) while the activations are live: the largest layer plus what
  is prefetched ahead, ``min(P, max(L, min(stage3_max_live_parameters, L + stage3_prefetch_bucket_size)))
  * w``, plus the largest layer's full gradient ``L * w`` (with no prefetch: DeepSpeed's
  ``largest_layer_memory = 4 * largest_layer_params`` in fp16). Its reduction is transient: a bucket's
  full gradients and their rows for the reduce-scatter, ``2 * B * w``, plus the received shards, up to
  ``T/N * w`` with ``overlap_comm`` (they are added up only when backward ends). With one bucket (K = 1)
  that happens once, at the end of backward, after the activations are gone and each module's gathered
  parameters were released after its gradient; otherwise buckets are launched while they are live. On the
  CPU stage 3 reduce-scatters each module's gradients once backward leaves it: there the transient is
  ``(2 * B' + 2 * B'/N) * w`` with ``B' = min(B, L)``, during backward (the gloo temporaries below still
  follow the configured ``B``, an upper bound). Where
  every partition group is one rank (N = 1 or MiCS shard groups of one, without ``offload_param``) the
  parameters are kept whole and each gradient goes straight into its accumulator: no bucket, no transient.

Collective temporaries (gloo, ranks on the CPU, N > 1). Measured with torch's gloo backend: an all-reduce
works in place, but every other collective first copies its data into one flat buffer of the whole
collective's size (NCCL works in place, so these are 0 on CUDA):

=========================================  ==================================================
collective                                 temporary
=========================================  ==================================================
``reduce_scatter`` (a list of pieces)      input minus this rank's piece, ``S * (N-1)/N``
``reduce_scatter_tensor``                  the whole input ``S``
``all_gather_into_tensor`` / a list        the whole output ``S``
``all_reduce``                             none
=========================================  ==================================================

So: stages 1-2 reduce-scatter each bucket (``B * w * (N-1)/N``; none with ``reduce_scatter: false``,
which all-reduces), during backward when K > 1 and at its end otherwise; after the optimizer step they
all-gather the updated model into the flat parameters (``min(P, N * allgather_bucket_size/N) * w``).
Stage 3 all-gathers each module's parameters (``L * w`` at most, live with the activations) and
reduce-scatters each bucket's rows (``B * w``).

Two more temporaries of the same kind, on any device (measured): in 16-bit, stage 2 adds each bucket's
received piece into its fp32 accumulator with ``add_``, which first makes an fp32 copy of the piece
(``4 * B/N``, when the bucket completes); and stages 1-2 cast the updated fp32 partition to the working
precision before gathering it (``P/N * w``, also with one rank). Neither exists with bf16 master state (the
accumulator and the masters are bf16 already). They are reported with the collective temporaries.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsrun.estimate.inputs import EstimateInputs, ceil_div


@dataclass(frozen=True)
class BufferBytes:
    """Buffer bytes per rank.

    ``reduce_bucket``: stage 2's persistent pool; ``gathered_params``: stage 3's gathered parameters;
    ``reduce_transient``: stage 3's buckets while they are reduced, launched while activations are live when
    ``transient_during_backward``. Collective temporaries (gloo only): ``collective_backward`` (live with
    the activations), ``collective_end`` (at the end of backward), ``collective_publish`` (the all-gather of
    the updated parameters after the optimizer step).
    """

    reduce_bucket: int
    gathered_params: int
    reduce_transient: int = 0
    transient_during_backward: bool = False
    collective_backward: int = 0
    collective_end: int = 0
    collective_publish: int = 0

    @property
    def backward(self) -> int:
        """Buffers live with the activations (forward/backward)."""
        transient = self.reduce_transient if self.transient_during_backward else 0
        return self.reduce_bucket + self.gathered_params + transient + self.collective_backward

    @property
    def end_of_backward(self) -> int:
        """Buffers live when the last buckets are reduced (activations and gathered parameters released)."""
        return self.reduce_bucket + self.reduce_transient + self.collective_end

    @property
    def publish(self) -> int:
        """Buffers live while the updated parameters are all-gathered after the step."""
        return self.reduce_bucket + self.collective_publish

    @property
    def persistent(self) -> int:
        """Buffers that stay allocated between steps (live during the optimizer step too)."""
        return self.reduce_bucket


def working_bytes(spec: EstimateInputs) -> int:
    return 2 if spec.mixed_precision else 4


def stage3_gathered_elements(spec: EstimateInputs) -> int:
    """Parameters ZeRO-3 holds gathered at once: the largest layer plus the prefetch, within the live cap."""
    largest = spec.largest_layer_params
    b = spec.buffers
    ahead = min(b.stage3_max_live_parameters, largest + b.stage3_prefetch_bucket_size)
    return min(spec.total_params, max(largest, ahead))


def host_cache_bytes(spec: EstimateInputs) -> int:
    """ZeRO-3 on the CPU with its parameters partitioned: the cache of freed host blocks in front of torch's
    allocator (dsrun/zero/host_memory.py) may hold up to its cap in every phase: ``ZERO3_HOST_CACHE_MODULES`` modules'
    gathered bytes (the largest layer's), or ``DSRUN_HOST_CACHE_MB`` when the environment sets it."""
    from dsrun.constants import ZERO3_HOST_CACHE_MODULES, zero3_host_cache_cap
    from dsrun.utils.errors import ConfigError

    default = ZERO3_HOST_CACHE_MODULES * spec.largest_layer_params * working_bytes(spec)
    try:
        return zero3_host_cache_cap(default)
    except ConfigError:  # the run refuses the value; the estimate keeps the default
        return default


def bucket_count(spec: EstimateInputs) -> int:
    """How many reduce buckets one backward fills: ``ceil(T / reduce_bucket_size)`` (at least 1)."""
    return max(1, ceil_div(spec.trainable, max(1, spec.buffers.reduce_bucket_size)))


def buffer_bytes(spec: EstimateInputs) -> BufferBytes:
    """Communication buffer bytes per rank for ``spec`` (see the module docstring)."""
    w = working_bytes(spec)
    b = spec.buffers
    n = spec.data_parallel_size  # ZeRO's group (with AutoTP, the ranks at one tensor-parallel position)
    bucket = min(b.reduce_bucket_size, spec.trainable)
    several = bucket_count(spec) > 1
    in_flight = 2 if spec.overlap_comm and several else 1
    reduce_bucket = gathered = transient = 0
    coll_backward = coll_end = coll_publish = 0
    gloo = spec.gloo and n > 1
    # data_types.keep_in_fp32_modules: the kept gradients fill buckets of their own, in fp32
    kept = spec.kept_trainable if spec.mixed_precision else 0
    kept_bucket, rest_bucket = min(b.reduce_bucket_size, kept), min(b.reduce_bucket_size, spec.trainable - kept)
    if spec.zero_stage == 2:
        for elements, size in ((rest_bucket, w), (kept_bucket, 4)):
            received = ceil_div(elements, n) if spec.offload_optimizer == "none" else 0
            reduce_bucket += (elements + received) * size * in_flight
    accumulate = 0
    reduced_during_backward = False  # stage 3 on the CPU: per-module buckets
    low = spec.bf16_master_state  # bf16 accumulator and masters: no fp32 piece, no cast to publish
    if spec.zero_stage == 2 and spec.mixed_precision and spec.offload_optimizer == "none" and not low:
        # fp32_accumulator.add_(16-bit received piece) materialises the piece in fp32 first
        accumulate = ceil_div(bucket, n) * 4
    if spec.zero_stage in (1, 2) and gloo:
        scatter = bucket * w * (n - 1) // n if b.reduce_scatter else 0
        during = several and (spec.zero_stage == 2 or spec.overlap_comm)
        coll_backward = scatter if during else 0
        coll_end = scatter
        chunk = max(1, b.allgather_bucket_size // n)
        coll_publish = min(spec.total_params, chunk * n) * w
    if spec.zero_stage in (1, 2):
        # the updated partition cast to the working precision before it is gathered (or copied, N = 1)
        coll_publish += ceil_div(spec.total_params, n) * w if spec.mixed_precision and not low else 0
    if accumulate:
        if several:
            coll_backward += accumulate
        coll_end += accumulate
    # every partition group one rank: parameters kept whole, gradients straight into their accumulators
    whole = spec.offload_param == "none" and (n == 1 or spec.mics_shard_size == 1)  # zero/whole_params.py
    if spec.zero_stage == 3 and not whole:
        if n > 1:  # one rank's partition is already the whole model
            gathered = stage3_gathered_elements(spec) * w + spec.largest_layer_params * w
            # released gather buffers kept for reuse, up to one module's gathered parameters (hooks.py's
            # GatherBufferPool): held in every phase; a gather takes its buffer out of the pool
            pool = min(max(spec.total_params - spec.small_params, 0), spec.largest_layer_params) * w \
                if spec.device == "cpu" else 0  # CUDA's caching allocator reuses freed blocks itself
            reduce_bucket += pool + host_cache_bytes(spec) if spec.device == "cpu" else pool
            gathered = max(gathered - pool, 0)
        received = (ceil_div(spec.trainable, n) if spec.overlap_comm else ceil_div(bucket, n)) if n > 1 else 0
        transient = (2 * bucket + received) * w
        if spec.device == "cpu" and n > 1 and spec.trainable > spec.largest_layer_params:
            # each module's gradients reduce-scattered once backward leaves it (stage3.py): buckets of at most L,
            # while the activations are live, each one's received shards added up once two more are in flight
            per_module = min(bucket, max(1, spec.largest_layer_params))
            transient = (2 * per_module + ceil_div(per_module, n) * (2 if spec.overlap_comm else 1)) * w
            reduced_during_backward = True
        if gloo:
            coll_backward = spec.largest_layer_params * w + (bucket * w if several else 0)
            coll_end = bucket * w
    return BufferBytes(reduce_bucket=reduce_bucket, gathered_params=gathered, reduce_transient=transient,
                       transient_during_backward=spec.zero_stage == 3 and (several or reduced_during_backward),
                       collective_backward=coll_backward, collective_end=coll_end, collective_publish=coll_publish)
