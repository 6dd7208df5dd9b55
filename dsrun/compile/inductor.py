"""How DeepCompile's graph makers reach AOT autograd's compilers (DeepSpeed's ``deepspeed.compile.inductor``).

AOT autograd is built from keyword arguments (``fw_compiler``, ``bw_compiler``, ``inference_compiler``,
``partition_fn``). :func:`_patch_deepcompile_aot_kwargs` wraps them: each compiler first runs DeepCompile's graph
maker on the graph (the passes, :mod:`.backend`), then the compiler it had; the partitioner first tags the joint
graph (ZeRO-3: the full parameter values and their aliases recomputed in backward) and records the frame it cut. A backward compiler that was not
given is the forward's. Arguments without a partitioner (a backend such as torch_xla's, which partitions
nothing) are left as they are. :func:`patch_create_aot_dispatcher_function` applies that to every ``AotAutograd``
built while one graph compiles: dsrun's ``eager`` DeepCompile backend is built this way; its ``inductor`` backend
reaches the same graphs through inductor's custom-pass hooks instead.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule

from dsrun.compile.partitioner import get_wrapped_partitioner


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
