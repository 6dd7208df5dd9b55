"""DeepCompile's graph ops (DeepSpeed's ``torch.ops.dc.*``, there C++/CUDA): ``torch.ops.dsrun_dc.*``.

Opaque custom ops over :class:`.handle.DeepCompileHandle`, so dynamo and inductor see them as single nodes:

``allgather_param(placeholder, ds_id) -> full``  the parameter's full value (its fake form has
    ``ds_shape``: the graph is traced at full shape while the parameter itself stays the empty placeholder).
    Its gradient is ``reduce_grad``: the backward reduce-scatters the full gradient into the strategy's
    buckets and gives the placeholder no gradient (``None``), as DeepSpeed's reduce does.
``prefetch_param(placeholder, ds_id) -> token``  start the gather early (the prefetch pass), and
``wait_allgather(placeholder, ds_id, token) -> full`` in place of the ``allgather_param`` it serves: the token
    (an empty tensor) ties the two, so no compiler can move the use before the start.
``release_param(full, ds_id)``  the gathered value's last reader has run (side effect: never removed).
``reduce_grad(grad, ds_id)``    hand the full gradient to ZeRO-3's reduction (side effect: never removed).
``reload_parameter(placeholder, after, graph_id, ds_id) -> token``  bring the parameter's shard back to the training
    device (``compile.offload_parameters``: :mod:`.shard_moves`); the gather reads the token (an empty tensor) in
    place of the placeholder, so no compiler can run the gather first, and ``after`` (the value computed just
    before it, or nothing) keeps a compiler from running the reload earlier.
``offload_parameter(full, graph_id, ds_id)``  move the shard to its host buffer; it reads the gathered value, so it
    runs after the gather (side effects, never removed).
``end_backward(deps, graph_id, release_reduce_buckets)``  a backward graph's reductions have all run (``deps``:
    the reduce nodes, so it comes after them); with ``release_reduce_buckets`` the pending buckets are launched.

:func:`define_deepspeed_ops` gives DeepSpeed's own ``torch.ops.dc.reduce_grad`` and ``dc.end_backward`` (its C++
library's schemas) the same meaning, where no library defined them: graphs written against DeepSpeed's ops
(``deepspeed.compile.fx``) then run on dsrun's handle.
"""
from __future__ import annotations

import torch

from dsrun.compile.handle import get_deepcompile_handle

LIB = "dsrun_dc"


@torch.library.custom_op(f"{LIB}::allgather_param", mutates_args=())
def allgather_param(placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    return get_deepcompile_handle().allgather(ds_id)


@allgather_param.register_fake
def _allgather_param_fake(placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    shape, dtype = get_deepcompile_handle().shape_of(ds_id)
    return placeholder.new_empty(shape, dtype=dtype)


@torch.library.custom_op(f"{LIB}::wait_allgather", mutates_args=())
def wait_allgather(placeholder: torch.Tensor, ds_id: int, token: torch.Tensor) -> torch.Tensor:
    return get_deepcompile_handle().allgather(ds_id)


@wait_allgather.register_fake
def _wait_allgather_fake(placeholder: torch.Tensor, ds_id: int, token: torch.Tensor) -> torch.Tensor:
    shape, dtype = get_deepcompile_handle().shape_of(ds_id)
    return placeholder.new_empty(shape, dtype=dtype)


@torch.library.custom_op(f"{LIB}::prefetch_param", mutates_args=())
def prefetch_param(placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    get_deepcompile_handle().prefetch(ds_id)
    return placeholder.new_empty(0)


@prefetch_param.register_fake
def _prefetch_param_fake(placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    return placeholder.new_empty(0)


@torch.library.custom_op(f"{LIB}::release_param", mutates_args=())
def release_param(full: torch.Tensor, ds_id: int) -> None:
    get_deepcompile_handle().release(ds_id)


@release_param.register_fake
def _release_param_fake(full: torch.Tensor, ds_id: int) -> None:
    return None


@torch.library.custom_op(f"{LIB}::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, ds_id: int) -> None:
    get_deepcompile_handle().reduce_grad(ds_id, grad)


@reduce_grad.register_fake
def _reduce_grad_fake(grad: torch.Tensor, ds_id: int) -> None:
    return None


@torch.library.custom_op(f"{LIB}::reload_parameter", mutates_args=())
def reload_parameter(placeholder: torch.Tensor, after: list[torch.Tensor], graph_id: int, ds_id: int) -> torch.Tensor:
    get_deepcompile_handle().reload_param(ds_id)
    return placeholder.new_empty(0)


@reload_parameter.register_fake
def _reload_parameter_fake(placeholder: torch.Tensor, after: list[torch.Tensor], graph_id: int,
                           ds_id: int) -> torch.Tensor:
    return placeholder.new_empty(0)


@torch.library.custom_op(f"{LIB}::offload_parameter", mutates_args=())
def offload_parameter(full: torch.Tensor, graph_id: int, ds_id: int) -> None:
    get_deepcompile_handle().offload_param(ds_id)


@offload_parameter.register_fake
def _offload_parameter_fake(full: torch.Tensor, graph_id: int, ds_id: int) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    ctx.ds_id = inputs[1]


def _allgather_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN201
    torch.ops.dsrun_dc.reduce_grad(grad, ctx.ds_id)
    return None, None


allgather_param.register_autograd(_allgather_backward, setup_context=_setup_context)

# DeepSpeed's schema (its deps are whatever the reductions return: None for dsrun's), hence a raw definition
_END_BACKWARD_SCHEMA = "end_backward(Any deps, int graph_id, bool release_reduce_buckets) -> ()"
_LIBRARIES: list[torch.library.Library] = []  # a Library's definitions live as long as the object


def _end_backward(deps: object, graph_id: int, release_reduce_buckets: bool) -> None:
    get_deepcompile_handle().end_backward(graph_id, release_reduce_buckets)


def _define(namespace: str, schemas: dict[str, tuple[str, object, object]]) -> None:
    """Each op's schema, its kernel, and its fake form (what tracing and compiling run: never the side effect)."""
    library = torch.library.Library(namespace, "FRAGMENT")
    for name, (schema, kernel, fake) in schemas.items():
        library.define(schema)
        library.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{name}", fake, lib=library)
        torch.fx.node.has_side_effect(getattr(torch.ops, namespace).__getattr__(name).default)
    _LIBRARIES.append(library)


def _end_backward_fake(deps: object, graph_id: int, release_reduce_buckets: bool) -> None:
    return None


_define(LIB, {"end_backward": (_END_BACKWARD_SCHEMA, _end_backward, _end_backward_fake)})


def _deepspeed_reduce_grad(grad: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    get_deepcompile_handle().reduce_grad(ds_id, grad)
    return grad.new_empty(0)  # DeepSpeed's returns an undefined tensor: nothing to read


def define_deepspeed_ops() -> bool:
    """Define ``torch.ops.dc.reduce_grad`` and ``dc.end_backward`` (DeepSpeed's schemas) over dsrun's handle;
    False, defining nothing, where some library (DeepSpeed's C++ one) has them already."""
    try:
        torch.ops.dc.reduce_grad.default
        return False
    except (AttributeError, RuntimeError):
        pass
    _define("dc", {"reduce_grad": ("reduce_grad(Tensor a, int graph_id, int id) -> Tensor", _deepspeed_reduce_grad,
                                   lambda grad, graph_id, ds_id: grad.new_empty(0)),
                   "end_backward": (_END_BACKWARD_SCHEMA, _end_backward, _end_backward_fake)})
    return True

# outputs nobody reads, effects that matter: dead-code elimination (FX's, inductor's) keeps them
torch.fx.node.has_side_effect(torch.ops.dsrun_dc.release_param.default)
torch.fx.node.has_side_effect(torch.ops.dsrun_dc.reduce_grad.default)
torch.fx.node.has_side_effect(torch.ops.dsrun_dc.reload_parameter.default)
torch.fx.node.has_side_effect(torch.ops.dsrun_dc.offload_parameter.default)

ALLGATHER = torch.ops.dsrun_dc.allgather_param.default
WAIT_ALLGATHER = torch.ops.dsrun_dc.wait_allgather.default
GATHERS = (ALLGATHER, WAIT_ALLGATHER)
PREFETCH = torch.ops.dsrun_dc.prefetch_param.default
RELEASE = torch.ops.dsrun_dc.release_param.default
REDUCE = torch.ops.dsrun_dc.reduce_grad.default
END_BACKWARD = torch.ops.dsrun_dc.end_backward.default
RELOAD_PARAM = torch.ops.dsrun_dc.reload_parameter.default
OFFLOAD_PARAM = torch.ops.dsrun_dc.offload_parameter.default
