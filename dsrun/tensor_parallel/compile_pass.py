"""The AutoTP compile pass (DeepSpeed's ``deepspeed.compile.passes.tp_compile`` and ``deepspeed.compile.init_tp``):
``compile: {deepcompile: true, passes: ["autotp"]}`` with ``engine.compile()`` compiles an AutoTP-split model as one
graph (``fullgraph``), its tensor-parallel collectives ops in that graph instead of autograd functions in the
layers' forwards.

:func:`defer_collectives_to_compiler` turns the layers' own collectives off (all layers or none: a layer the pass
cannot rewrite raises before any flag is set, since a layer left on the module path would lose its backward
all-reduce in a full graph). The backend (:func:`init_autotp`) rewrites dynamo's graph
(:func:`pass_insert_tp_collectives`): after the matmul of a row-parallel layer ``reduce_from_tp_region`` (every
reader gets the summed value, before the bias is added); before the column-parallel matmuls reading one activation
one ``copy_to_tp_region`` (its gradient summed over the group). Which layer a matmul belongs to is read from the
node's ``nn_module_stack``. The ops are :mod:`.graph_collectives`. ``LmHeadLinearAllreduce`` (it cuts its own
input) is refused; so is ``tensor_parallel.tp_overlap_comm`` (its overlap is the layer's autograd function).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from packaging.version import Version
from torch.fx import GraphModule, Node

from . import graph_collectives
from .deepspeed_layers import LmHeadLinearAllreduce
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLinear

COLUMN_PARALLEL_OP = graph_collectives.COLUMN_PARALLEL_OP
ROW_PARALLEL_OP = graph_collectives.ROW_PARALLEL_OP
GATHER_OUTPUT_OP = graph_collectives.GATHER_OUTPUT_OP  # emitted by a gather_output layer's own forward

AUTOTP_MIN_TORCH_VERSION = 2.6
# transformers releases whose batched_mm experts mutate the routing tensor in place (huggingface/transformers#45621)
BROKEN_TRANSFORMERS_MOE_VERSIONS = ("5.8.0", "5.10.1")

COLUMN_PARALLEL_LAYERS = (ColumnParallelLinear,)  # LinearLayer, the sub-parameter and fused layers
ROW_PARALLEL_LAYERS = (RowParallelLinear,)  # LinearAllreduce, SubParamLinearAllreduce
UNSUPPORTED_LAYERS = (LmHeadLinearAllreduce,)  # slices its own input: no matmul the pass could stand behind
_MATMUL_TARGETS = {torch.matmul, torch.ops.aten.matmul.default, torch.ops.aten.linear.default, torch._C._nn.linear}


def _in_family(layer_type: object, family: tuple[type, ...]) -> bool:
    return isinstance(layer_type, type) and not issubclass(layer_type, UNSUPPORTED_LAYERS) and \
        issubclass(layer_type, family)


def _is_column_parallel(layer_type: object) -> bool:
    return _in_family(layer_type, COLUMN_PARALLEL_LAYERS)


def _is_row_parallel(layer_type: object) -> bool:
    return _in_family(layer_type, ROW_PARALLEL_LAYERS)


def defer_collectives_to_compiler(model: torch.nn.Module) -> None:
    """Every tensor-parallel layer of ``model`` (with a group) leaves its collectives to the graph; a layer the
    pass cannot rewrite raises ``NotImplementedError`` before any layer is changed."""
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, TensorParallelLinear) or module.mp_group is None:
            continue
        layer_type = type(module)
        if not (_is_column_parallel(layer_type) or _is_row_parallel(layer_type)):
            raise NotImplementedError(
                f"AutoTP compile pass cannot rewrite '{name}' ({layer_type.__name__}), and leaving it on the "
                "module-level path under a full graph would drop its backward collective; drop 'autotp' from "
                "compile.passes for this model")
        if TensorParallelLinear.overlap_comm:
            raise NotImplementedError("AutoTP compile pass does not support tensor_parallel.tp_overlap_comm; set it "
                                      "to false to emit the collectives into the graph")
        layers.append(module)
    for module in layers:
        module.defer_collectives_to_compiler = True


def _originating_layer_type(node: Node) -> type | None:
    """The innermost module type ``node`` was traced from (dynamo's ``nn_module_stack``), or None."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][1] if stack else None


def _originating_layer(node: Node) -> str | None:
    """The innermost module ``node`` was traced from, by its path in the model, or None."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else None


def pass_insert_tp_collectives(gm: GraphModule, real_inputs: Sequence[Any]) -> None:
    """``reduce_from_tp_region`` after each row-parallel matmul, ``copy_to_tp_region`` before the column-parallel
    matmuls of each activation (a gather_output layer's gather is already in the graph: its forward emits it)."""
    graph = gm.graph
    column_readers: dict[Node, list[Node]] = {}
    layers = {_originating_layer(n) for n in graph.nodes if _is_column_parallel(_originating_layer_type(n))
              or _is_row_parallel(_originating_layer_type(n))}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MATMUL_TARGETS:
            continue
        layer_type = _originating_layer_type(node)
        layers.discard(_originating_layer(node))
        if _is_row_parallel(layer_type):
            with graph.inserting_after(node):
                reduced = graph.call_function(ROW_PARALLEL_OP, (node,))
            reduced.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
        elif _is_column_parallel(layer_type):
            column_readers.setdefault(node.args[0], []).append(node)
    if layers:  # its matmul went through something else (a replaced F.linear): its collective would be lost
        raise RuntimeError(f"AutoTP compile pass found no matmul of the split layer {sorted(layers)[0]!r} in the graph "
                           "to put its collective at; compile without 'autotp' in compile.passes")
    for activation, readers in column_readers.items():
        with graph.inserting_before(readers[0]):
            copied = graph.call_function(COLUMN_PARALLEL_OP, (activation,))
        copied.meta["val"] = activation.meta.get("val")
        for reader in readers:
            reader.replace_input_with(activation, copied)


def pass_canonicalize(gm: GraphModule, real_inputs: Sequence[Any]) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


AUTOTP_PASSES = [pass_insert_tp_collectives, pass_canonicalize]


def apply_autotp(gm: GraphModule, real_inputs: Sequence[Any], passes: list[Callable] | None = None) -> GraphModule:
    for opt_pass in passes or AUTOTP_PASSES:
        opt_pass(gm, real_inputs)
    return gm


def _check_broken_transformers_moe(model: torch.nn.Module) -> None:
    """RuntimeError for a model whose experts run transformers' batched_mm path in the releases that mutate the
    routing tensor in place (no full graph can capture it)."""
    try:
        import transformers
    except ImportError:
        return
    first_broken, first_fixed = BROKEN_TRANSFORMERS_MOE_VERSIONS
    if not Version(first_broken) <= Version(transformers.__version__) < Version(first_fixed):
        return
    experts = [name for name, module in model.named_modules()
               if hasattr(module, "_apply_gate") and hasattr(module, "is_concatenated")
               and getattr(getattr(module, "config", None), "_experts_implementation", None) == "batched_mm"]
    if experts:
        raise RuntimeError(
            f"transformers {transformers.__version__} mutates the MoE routing tensor in place inside "
            "batched_mm_experts_forward (huggingface/transformers#45621, fixed by #45634), and this model routes "
            f"through it (e.g. '{experts[0]}'): the AutoTP compile pass cannot capture a full graph; upgrade to "
            f"transformers >= {first_fixed}")


def init_autotp(model: torch.nn.Module, backend: str = "inductor") -> Callable:
    """The torch.compile backend for an AutoTP-split ``model`` whose collectives the graph now carries
    (``backend``: ``inductor`` generates code, ``eager`` runs the rewritten graph as it is)."""
    from dsrun.utils.torch_version import required_torch_version

    if not required_torch_version(min_version=AUTOTP_MIN_TORCH_VERSION):
        raise RuntimeError(f"The AutoTP compile pass requires PyTorch >= {AUTOTP_MIN_TORCH_VERSION}, found "
                           f"{torch.__version__}.")
    _check_broken_transformers_moe(model)
    defer_collectives_to_compiler(model)

    def backend_fn(gm: GraphModule, real_inputs: list[Any]) -> Callable:
        apply_autotp(gm, real_inputs)
        if backend == "eager":
            return gm.forward
        return torch._inductor.compile(gm, real_inputs)

    return backend_fn
