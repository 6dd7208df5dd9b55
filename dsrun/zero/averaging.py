"""How data-parallel gradients are averaged around their reduction (``prescale_gradients``,
``gradient_predivide_factor``, ``gradient_allreduce_op``): DeepSpeed's rule, in one place.

Every reduction in dsrun (the ZeRO stages' buckets, ``engine.allreduce_bucket``) divides its payload by
``pre_divide`` before the collective and multiplies what it received by ``post_scale`` at once, so a reduced
gradient is the average (reducing it again, as a second backward before the step does, keeps it). As DeepSpeed (``engine.allreduce_bucket``, ZeRO-1/2's
``gradient_reduction_w_predivide`` and ``average_tensor``, ZeRO-3's ``__avg_scatter_contiguous_grads``):

* ``prescale_gradients: true``: divide by the world size before, nothing after;
* off (the default), an all-reduce (stage 0; stages 1-2 with ``reduce_scatter: false``): divide by
  ``gradient_predivide_factor`` before and by ``world / factor`` after (factor 1: the sum goes on the wire);
* off, a reduce-scatter (stages 1-2 by default, stage 3): divide by the world size and the factor before and
  multiply by the factor after (DeepSpeed refuses a factor other than 1 or prescaling with its reduce-scatter at
  stages 1-3; dsrun takes both, with stage 3's rule);
* ``gradient_allreduce_op: sum``: the plain sum, no division.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GradientAveraging:
    pre_divide: float  # the payload is the gradient divided by this
    post_scale: float  # the reduced sum times this is the average

    def before(self, tensor) -> None:
        """Divide ``tensor`` (the payload, in place) before the collective."""
        if self.pre_divide != 1.0:
            tensor.div_(self.pre_divide)

    def after(self, tensor) -> None:
        """Finish the average of a reduced ``tensor`` in place."""
        if self.post_scale != 1.0:
            tensor.mul_(self.post_scale)


def gradient_averaging(world: int, *, average: bool, prescale: bool, factor: float, scatter: bool
                       ) -> GradientAveraging:
    """The rule for a reduction over ``world`` ranks (``scatter``: a reduce-scatter, else an all-reduce)."""
    if not average:
        return GradientAveraging(1.0, 1.0)
    if prescale:
        return GradientAveraging(float(world), 1.0)
    factor = float(factor)
    if scatter:
        return GradientAveraging(factor * world, factor)
    return GradientAveraging(factor, factor / world)
