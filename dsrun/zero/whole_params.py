"""ZeRO-3 on partition groups of one: parameters kept whole, no gather or release hooks.

A parameter partitioned over a group of one rank (a data-parallel world of one; MiCS shard groups of one) has
one shard, and that shard *is* the whole parameter: gathering it only points ``.data`` at the shard, releasing
it only points ``.data`` away again. When every parameter of the model is in that case the stage-3 strategy
keeps them whole instead of running the :class:`~.hooks.ParameterCoordinator`: :class:`WholeParameters` points
each parameter's ``.data`` at its shard viewed in the full shape, once, and has the coordinator's interface with
nothing to do. No module gets a forward hook, no ``_parameters`` dict is replaced, no gather or release runs;
the strategy puts each finished gradient straight into its sub-group's accumulator (no bucket,
:mod:`.stage3`), measures the clipping norm as stage 0 does, and ``F.linear`` is torch's own for a whole weight
(:mod:`.linear`). The step updates the shard in place (fp32: the shard is a view of its fp32 master; 16-bit: the
store writes it), so ``.data`` is current after every step without a copy.

What DeepSpeed's attributes say of a whole parameter: ``ds_status`` is AVAILABLE, ``ds_tensor`` the shard
(``ds_numel`` elements, ``ds_world_size`` 1) that ``.data`` views, ``ds_whole`` True (dsrun's: never released,
:func:`~.partition_params.release_param`). ``GatheredParameters`` gathers nothing; with ``modifier_rank`` it
still writes the values back into the shard and the fp32 master. Checkpoints keep the partitioned layout (the
module's parameters saved as placeholders, the values in the fp32 flat groups with ``partition_count`` 1), so a
world-1 checkpoint resumes at any world size as before.

Not kept whole (the strategy keeps the coordinator): ``offload_param`` (the shards live in host memory or NVMe
files; a gather is what brings one to the device) and frozen shards kept INT8
(``zero_quantized_nontrainable_weights``: the shard is a message, not values).
"""
from __future__ import annotations

from typing import Iterable

import torch

from dsrun.utils.leaf_modules import PARAM_LEAF_ATTR, z3_leaf_module
from dsrun.zero import quantized_shards
from dsrun.zero.partition_params import WHOLE_ATTR, GatherBufferPool, ParamStatus


def keeps_whole(params: Iterable[torch.nn.Parameter], param_offload: object | None) -> bool:
    """Whether the stage-3 strategy can keep every one of ``params`` (partitioned) whole: each is partitioned
    over a group of one rank, none is offloaded (``param_offload``) and none keeps its shard as an INT8 message."""
    return param_offload is None and all(p.ds_world_size == 1 and quantized_shards.message_of(p) is None
                                         for p in params)


def is_whole(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter kept whole (see the module docstring)."""
    return bool(getattr(param, WHOLE_ATTR, False))


class WholeParameters:
    """What the stage-3 strategy holds instead of a :class:`~.hooks.ParameterCoordinator` when every parameter
    is kept whole: the coordinator's interface, with no hooks. :meth:`keep_whole` (once the sub-groups have
    placed the shards) points each parameter's ``.data`` at its shard."""

    def __init__(self, root: torch.nn.Module, params: list[torch.nn.Parameter]):
        self.root = root
        self.params = {id(p): p for p in params}
        self.buffer_pool = GatherBufferPool(0)  # nothing is gathered, so no buffer is ever kept
        self.after_fetch = None
        self.prefetched_numel = 0
        self._leaf_params: list[torch.nn.Parameter] = []
        for leaf in [m for m in root.modules() if z3_leaf_module(m)]:  # DeepSpeed's marks, as the coordinator's
            for p in leaf.parameters():
                if id(p) in self.params and not hasattr(p, PARAM_LEAF_ATTR):
                    setattr(p, PARAM_LEAF_ATTR, leaf)
                    self._leaf_params.append(p)

    def keep_whole(self) -> None:
        """Point every parameter's ``.data`` at its shard in the full shape (again, should the shard have been
        replaced)."""
        for p in self.params.values():
            if p.ds_handle is not None:
                p.ds_handle.wait()  # an old gather's buffer, never used again
            p.data = p.ds_tensor.view(p.ds_shape)
            p.ds_status = ParamStatus.AVAILABLE
            p.ds_gathered = None
            setattr(p, WHOLE_ATTR, True)

    # --- the coordinator's interface: nothing to gather, nothing to release --------------------------------
    def begin_forward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def release_after_grad(self, param: torch.nn.Parameter) -> None:
        pass

    def invalidate(self) -> None:
        """The shards changed (a step, a load): ``.data`` views them already; kept pointing at them."""
        self.keep_whole()

    def remove_hooks(self) -> None:
        """The engine is closing: the parameters stay whole, but a later engine decides again."""
        for p in self.params.values():
            if hasattr(p, WHOLE_ATTR):
                delattr(p, WHOLE_ATTR)
        for p in self._leaf_params:
            if hasattr(p, PARAM_LEAF_ATTR):
                delattr(p, PARAM_LEAF_ATTR)
        self._leaf_params = []
