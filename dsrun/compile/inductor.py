"""How DeepCompile's graph makers reach AOT autograd's compilers (DeepSpeed's ``deepspeed.compile.inductor``).

AOT autograd is built from keyword arguments (``fw_compiler``, ``bw_compiler``, ``inference_compiler``,
``partition_fn``). :func:`_patch_deepcompile_aot_kwargs` wraps them: each compiler first runs DeepCompile's graph
maker on the graph (the passes, :mod:`.backend`), then the compiler it had; the partitioner first tags the joint
graph (ZeRO-3: the full parameter values and their aliases recomputed in backward) and records the frame it cut. A backward compiler that was not
given is the forward's. Arguments without a partitioner (a backend such as torch_xla's, which partitions
nothing) are left as they are. :func:`patch_create_aot_dispatcher_function` applies that to every ``AotAutograd``
built while one graph compiles: dsrun's ``eager`` DeepCompile backend is built this way; its ``inductor`` backend
reaches the same graphs through inductor's custom-pass hooks instead.

:func:`register_custom_ops` (called by the ``inductor`` backend before its first compile) lowers DeepCompile's ops
as fallback kernels whose buffers inductor never plans another tensor into: a gathered parameter's storage is the
handle's (a kept copy outlives the graph), so inductor must not reuse it, nor the inputs of a release or a reduce.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule

import torch.utils._pytree as pytree
from torch._inductor.ir import FallbackKernel, IRNode, TensorBox
from torch._inductor.lowering import add_needs_realized_inputs, fallbacks, register_lowering
from torch._inductor.scheduler import Scheduler
from torch._inductor.virtualized import V

from dsrun.compile.ops import (ALLGATHER, END_BACKWARD, OFFLOAD_PARAM, PREFETCH, REDUCE, RELEASE, RELOAD_PARAM,
                               WAIT_ALLGATHER)
from dsrun.compile.partitioner import get_wrapped_partitioner
from dsrun.compile.util import _deepspeed_op

# inductor's names DeepSpeed's module holds (patched there by its tests) are this module's too
__all__ = ["patch_compiler", "wrap_partition_fn", "patch_create_aot_dispatcher_function", "register_custom_ops",
           "IRNode", "V", "Scheduler", "add_needs_realized_inputs", "fallbacks", "register_lowering"]

# (op, its inputs' buffers never reused, its outputs' never reused): dsrun's ops, then DeepSpeed's where defined
_DSRUN_OPS = ((ALLGATHER, False, True), (PREFETCH, False, True), (WAIT_ALLGATHER, True, True),
              (RELEASE, True, False), (REDUCE, True, True), (END_BACKWARD, True, False), (RELOAD_PARAM, False, False),
              (OFFLOAD_PARAM, False, False))
_DEEPSPEED_OPS = (("allgather_param", False, True), ("wait_allgather", True, True), ("release_param", True, False),
                  ("reduce_grad", True, True), ("free_tensors", True, True), ("offload_tensor", False, True),
                  ("wait_offload", True, True), ("reload_tensor", True, True), ("wait_reload", True, True),
                  ("end_backward", True, False))


def _get_graphsafe_run_with_rng_state() -> object | None:
    """torch's ``graphsafe_run_with_rng_state`` (the RNG state a recomputed region replays), where it exists."""
    try:
        from torch._prims import rng_prims
    except ImportError:
        return None
    return getattr(rng_prims, "graphsafe_run_with_rng_state", None)


def _register_graphsafe_rng_state_no_reuse(register_fallback_no_reuse: Callable[..., object]) -> bool:
    """Its outputs (RNG states) never reused: a recompute in the backward reads them after the forward."""
    op = _get_graphsafe_run_with_rng_state()
    if op is None:
        return False
    register_fallback_no_reuse(op, never_reuse_output=True)
    return True


def _mark_output_never_reuse(out: object, *, enabled: bool) -> object:
    if enabled and isinstance(out, IRNode):
        V.graph.never_reuse_buffers.add(out.get_name())
    return out


def _fallback_no_reuse(op: object, never_reuse_input: bool) -> Callable[..., object]:
    """The lowering: the op as a fallback kernel, its (realized) inputs kept from reuse when asked."""

    def keep(x: object) -> None:
        if isinstance(x, IRNode):
            try:
                V.graph.never_reuse_buffers.add(x.get_name())
            except NotImplementedError:  # not a buffer of its own (a view not realized): its base is not ours
                pass

    def lower(*args: object, **kwargs: object) -> object:
        out = FallbackKernel.create(op, *args, **kwargs)  # realizes the inputs into named buffers
        if never_reuse_input:
            pytree.tree_map(keep, (args, kwargs))
        return out

    return lower


def register_custom_ops() -> None:
    """Lower each DeepCompile op (dsrun's; DeepSpeed's ``torch.ops.dc`` ones another library defined) and torch's
    ``graphsafe_run_with_rng_state`` as fallback kernels with their no-reuse marks (DeepSpeed's function; it also
    turns inductor's scheduler dead-node elimination off, which dsrun does not: its side-effect ops are marked
    ``has_side_effect``, which that elimination respects)."""

    def register_fallback_no_reuse(op: object, never_reuse_input: bool = False,
                                   never_reuse_output: bool = False) -> object:
        fallbacks.add(op)
        add_needs_realized_inputs(op)
        lower = _fallback_no_reuse(op, never_reuse_input)

        def handler(*args: object, **kwargs: object) -> object:
            wrap = (lambda x: _mark_output_never_reuse(TensorBox.create(x) if isinstance(x, IRNode) else x,
                                                       enabled=never_reuse_output))
            return pytree.tree_map(wrap, lower(*args, **kwargs))

        return register_lowering(op, type_promotion_kind=None)(handler)

    for op, never_in, never_out in _DSRUN_OPS:
        register_fallback_no_reuse(op, never_reuse_input=never_in, never_reuse_output=never_out)
    for name, never_in, never_out in _DEEPSPEED_OPS:
        op = _deepspeed_op(name)
        if op is not None:
            register_fallback_no_reuse(op, never_reuse_input=never_in, never_reuse_output=never_out)
    _register_graphsafe_rng_state_no_reuse(register_fallback_no_reuse)


def patch_compiler(original_compiler: Callable, dc_compiler: Callable, z3_partition: bool, graph_id: int,
                   graph_param_manager: object, bwd: bool) -> Callable:
    """``original_compiler`` run on what ``dc_compiler(gm, inputs)`` made of the graph (a graph, or a module)."""

    def wrapped_compiler(gm: GraphModule, inputs: Sequence[torch.Tensor]) -> Any:
        made = dc_compiler(gm, inputs)
        if isinstance(made, torch.fx.Graph) and made is not gm.graph:
            gm.graph = made
            gm.recompile()
        elif isinstance(made, GraphModule):
            gm = made
        return original_compiler(gm, inputs)

    return wrapped_compiler


def wrap_partition_fn(z3_partition: bool, partition_fn: Callable, real_inputs: Sequence[object],
                      param_indices: Sequence[tuple],
                      frame_id: int, frames_partitioned: set[int]) -> Callable:
    """``partition_fn`` after the full parameter values and their aliases are marked for recomputation
    (``z3_partition``; :func:`dsrun.compile.partitioner.get_wrapped_partitioner`); the frame is recorded in
    ``frames_partitioned``."""
    return get_wrapped_partitioner(z3_partition, param_indices, partition_fn, frame_id, frames_partitioned)


def _patch_deepcompile_aot_kwargs(kwargs: dict[str, Any], *, graph_id: int, z3_partition: bool,
                                  make_fw_graph: Callable, make_bw_graph: Callable, real_inputs: Sequence[object],
                                  param_indices: Sequence[tuple], param_manager: object, frame_id: int,
                                  frames_partitioned: set[int]) -> bool:
    """Wrap AOT autograd's ``kwargs`` in place; False (nothing changed) without a forward compiler and a
    partitioner."""
    forward, partition = kwargs.get("fw_compiler"), kwargs.get("partition_fn")
    if not forward or not partition:
        return False
    backward = kwargs.get("bw_compiler") or forward
    kwargs["fw_compiler"] = patch_compiler(forward, make_fw_graph, z3_partition, graph_id, param_manager, bwd=False)
    kwargs["bw_compiler"] = patch_compiler(backward, make_bw_graph, z3_partition, graph_id, param_manager, bwd=True)
    kwargs["inference_compiler"] = kwargs["fw_compiler"]
    kwargs["partition_fn"] = wrap_partition_fn(z3_partition, partition, real_inputs, param_indices, frame_id,
                                               frames_partitioned)
    return True


def patch_create_aot_dispatcher_function(graph_id: int, z3_partition: bool, make_fw_graph: Callable,
                                         make_bw_graph: Callable, real_inputs: Sequence[object],
                                         param_indices: Sequence[tuple], param_manager: object, frame_id: int,
                                         frames_partitioned: set[int]) -> Callable[[], None]:
    """Until the returned callback runs, every ``AotAutograd`` built (``aot_autograd(...)``, inductor's
    ``compile_fx``) has its arguments wrapped by :func:`_patch_deepcompile_aot_kwargs` for this graph. The patch is
    process-wide, so one graph owns it at a time: a newer patch replaces an older one, and an older owner's
    restore leaves a newer patch in place (restoring twice is harmless)."""
    import functools

    from torch._dynamo.backends.common import AotAutograd

    if hasattr(AotAutograd, "__original_init"):  # a patch still installed: the constructor it replaced first
        AotAutograd.__init__ = getattr(AotAutograd, "__original_init")
        delattr(AotAutograd, "__original_init")
    original_init = AotAutograd.__init__

    @functools.wraps(original_init)
    def patched_init(self: object, **kwargs: object) -> None:
        _patch_deepcompile_aot_kwargs(kwargs, graph_id=graph_id, z3_partition=z3_partition,
                                      make_fw_graph=make_fw_graph, make_bw_graph=make_bw_graph,
                                      real_inputs=real_inputs, param_indices=param_indices,
                                      param_manager=param_manager, frame_id=frame_id,
                                      frames_partitioned=frames_partitioned)
        original_init(self, **kwargs)

    setattr(AotAutograd, "__original_init", original_init)
    AotAutograd.__init__ = patched_init

    def restore() -> None:
        if AotAutograd.__init__ is patched_init:
            AotAutograd.__init__ = original_init
            if getattr(AotAutograd, "__original_init", None) is original_init:
                delattr(AotAutograd, "__original_init")

    return restore
