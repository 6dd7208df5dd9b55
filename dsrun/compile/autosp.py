"""AutoSP (DeepSpeed's ``init_sp``, ``passes.sp_compile`` and ``custom_ops.all_to_all``; its slicing of an input is
:func:`.util.shard_tensor_node`, its tags :mod:`.constants`): Ulysses sequence parallelism written into a dynamo
graph.

``compile: {deepcompile: true, passes: ["autosp"]}`` with ``sequence_parallel_size`` P makes ``engine.compile()``
compile the model as one graph whose inputs are the whole sequence, and rewrite it (:func:`apply_autosp`): each
rank keeps its 1/P of the sequence of the tagged inputs, and each ``F.scaled_dot_product_attention`` gets its
query, key and value through an all-to-all (``[B, N, S/P, H] -> [B, N/P, S, H]``: all the sequence, 1/P of the
heads) and its output through the reverse one, the ``autosp::all_to_all`` op over :mod:`.sp_mesh`'s group, whose
gradient is the reverse all-to-all. Everything else runs on the rank's part of the sequence.

The inputs are found by their tag: :func:`prepare_autosp_inputs` sets ``tensor.tag`` on the input ids, labels
and positions (dynamo copies a tensor's attributes into its placeholder's ``meta['tensor_dict']``) and marks
their sequence dimension dynamic, so the graph holds that length as a symbol (a SymInt placeholder named for it).
:func:`shard_tensor_node` then makes every reader of such an input read this rank's slice of the sequence:
``x[:, start:end]`` with ``chunk = s // sp_size``, ``start = sp_rank * chunk``, ``end = start + chunk``
(:func:`create_shard_offsets`; ``sp_size`` and the rank are read from :mod:`.sp_mesh` and :mod:`dsrun.comm` when
the edit is made, and baked into the graph).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from dsrun import comm
from dsrun.compile import sp_mesh
from dsrun.compile.constants import AUTOSP_INPUT_ID_KEY, AUTOSP_LABEL_ID_KEY, AUTOSP_POSITION_ID_KEY
from dsrun.compile.util import (find_node_by_name, get_input_id_node, get_label_id_node, get_node_shape_meta,
                                get_position_id_node, get_sdpa_nodes, shard_tensor_node)
from dsrun.utils.logging import log_dist
from dsrun.utils.torch_version import required_torch_version


def prepare_autosp_inputs(input_id: torch.Tensor, label_id: torch.Tensor, position_id: torch.Tensor | None = None,
                          attention_mask: torch.Tensor | None = None, seq_dim: int = 1) -> tuple:
    """Tag the input ids, labels (and positions) for AutoSP and mark ``seq_dim`` of each given tensor dynamic;
    returns them as given."""
    if input_id is None:
        raise ValueError("input_id is required")
    if label_id is None:
        raise ValueError("label_id is required")
    if not 0 <= seq_dim < input_id.ndim:
        raise ValueError(f"seq_dim {seq_dim} must be a valid index for input_id with shape {tuple(input_id.shape)}")
    for name, tensor in (("position_id", position_id), ("attention_mask", attention_mask)):
        if tensor is not None and seq_dim >= tensor.ndim:
            raise ValueError(f"seq_dim {seq_dim} is out of bounds for {name} with shape {tuple(tensor.shape)}")
    for tensor in (input_id, label_id, position_id, attention_mask):
        if tensor is not None:
            torch._dynamo.decorators.mark_dynamic(tensor, seq_dim)
    input_id.tag = AUTOSP_INPUT_ID_KEY
    label_id.tag = AUTOSP_LABEL_ID_KEY
    if position_id is not None:
        position_id.tag = AUTOSP_POSITION_ID_KEY
    return input_id, label_id, position_id, attention_mask


# --- the all-to-all op (DeepSpeed's custom_ops.all_to_all) --------------------------------------------------------
@torch.library.custom_op("autosp::all_to_all", mutates_args=())
def all_to_all(input: torch.Tensor, scatter_idx: int, gather_idx: int, name: str) -> torch.Tensor:
    """Ulysses' all-to-all of a ``[B, N, S, H]`` tensor over this rank's sequence-parallel group: dimension
    ``scatter_idx`` split P ways, ``gather_idx`` gathered (``name``: which tensor, for a reader of the graph)."""
    from dsrun.sequence.layer import single_all_to_all

    if not sp_mesh.is_setup():
        raise RuntimeError("autosp::all_to_all before AutoSP's mesh was set up (sp_mesh.populate_registry)")
    # contiguous, as the fake form says: inductor checks a custom op's real strides against its fake ones
    return single_all_to_all(input.contiguous(), scatter_idx, gather_idx, group=sp_mesh.my_group()).contiguous()


def _unsplit(dim: object, factor: int) -> object:
    """``dim * factor``, as the symbol ``s`` itself where ``dim`` is ``s // factor`` (the sequence split by
    :func:`pass_shard_seq_dim`), so the shapes after the all-to-all agree with the graph's own ``s``."""
    from torch.utils._sympy.functions import FloorDiv

    node = getattr(dim, "node", None)
    if node is not None and isinstance(node.expr, FloorDiv) and node.expr.args[1] == factor:
        hint = node.hint * factor if node.has_hint() else None
        return node.shape_env.create_symintnode(node.expr.args[0], hint=hint)
    return dim * factor


@all_to_all.register_fake
def _all_to_all_fake(input: torch.Tensor, scatter_idx: int, gather_idx: int, name: str) -> torch.Tensor:
    shape = list(input.shape)
    p = sp_mesh.sp_size()
    shape[scatter_idx] = shape[scatter_idx] // p
    shape[gather_idx] = _unsplit(shape[gather_idx], p)
    return input.new_empty(shape)


def _all_to_all_setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    _, ctx.scatter_idx, ctx.gather_idx, ctx.name = inputs


def _all_to_all_backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
    return torch.ops.autosp.all_to_all(grad, ctx.gather_idx, ctx.scatter_idx, ctx.name + "_grad"), None, None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


# --- the passes (DeepSpeed's passes.sp_compile) -------------------------------------------------------------------
def pass_shard_seq_dim(gm: GraphModule, example_inputs: object) -> None:
    """Readers of the sequence length ``s`` downstream of the tagged inputs read ``s // P``: what the rank holds."""
    input_ids = get_input_id_node(gm)
    seq = get_node_shape_meta(input_ids).shape[1]
    if not isinstance(seq, torch.SymInt):
        raise ValueError("the input ids' sequence dimension is not symbolic: compile with dynamic=True or "
                         "prepare_autosp_inputs(...)")
    seq_node = find_node_by_name(gm, str(seq))
    if seq_node is None:
        log_dist("AutoSP: no graph node holds the sequence length; its readers are left as they are", ranks=[0])
        return
    with gm.graph.inserting_after(seq_node):
        sharded = gm.graph.call_function(operator.floordiv, args=(seq_node, sp_mesh.sp_size()))
    reached, work = set(), [n for n in (input_ids, get_label_id_node(gm), get_position_id_node(gm)) if n is not None]
    while work:
        node = work.pop()
        if node not in reached:
            reached.add(node)
            work.extend(node.users)
    for node in reached:
        if seq_node in node.all_input_nodes:
            node.replace_input_with(seq_node, sharded)


def pass_shard_inputs(gm: GraphModule, example_inputs: object) -> None:
    """The input ids, labels and (where tagged) positions sliced to this rank's part of the sequence."""
    for node in (get_input_id_node(gm), get_label_id_node(gm), get_position_id_node(gm)):
        if node is not None:
            shard_tensor_node(gm, node)


def pass_insert_attention_all_to_all(gm: GraphModule, example_inputs: object) -> None:
    """Each SDPA's q, k, v through ``[B, N, S/P, H] -> [B, N/P, S, H]``, its output back."""
    attention = get_sdpa_nodes(gm)
    if not attention:
        raise RuntimeError("AutoSP found no torch.nn.functional.scaled_dot_product_attention in the compiled graph: "
                           "the model's attention must call it (for Hugging Face models attn_implementation='sdpa')")

    def insert(node: Node, scatter_idx: int, gather_idx: int, name: str) -> None:
        with gm.graph.inserting_after(node):
            exchanged = gm.graph.call_function(torch.ops.autosp.all_to_all.default,
                                               args=(node, scatter_idx, gather_idx, name))
        exchanged.name = f"a2a_{name}"
        node.replace_all_uses_with(exchanged)
        exchanged.update_arg(0, node)

    for idx, sdpa in enumerate(attention):
        suffix = f"_{idx}" if len(attention) > 1 else ""
        for node, name in zip(sdpa.args[:3], "qkv"):
            insert(node, 1, 2, name + suffix)
        insert(sdpa, 2, 1, "o" + suffix)


def pass_propagate_shapes(gm: GraphModule, real_inputs: list) -> None:
    """The nodes' fake values again, through the edited graph, in the graph's own fake mode (its shape
    environment holds the sequence's symbol)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, maybe_get_fake_mode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = None
    for node in gm.graph.nodes:
        value = get_node_shape_meta(node)
        if isinstance(value, torch.Tensor):
            mode = maybe_get_fake_mode(value)
            if mode is not None:
                break
    mode = mode or FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in real_inputs]
    FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*fakes)


def pass_canonicalize(gm: GraphModule, real_inputs: list) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


AUTOSP_PASSES = (pass_shard_seq_dim, pass_shard_inputs, pass_insert_attention_all_to_all, pass_propagate_shapes,
                 pass_canonicalize)


def apply_autosp(gm: GraphModule, real_inputs: list, debug: bool = False, passes: list | None = None,
                 sp_size: int = 2, dp_size: int = 1) -> None:
    """The AutoSP passes on ``gm`` (dynamo's graph), the mesh of ``dp_size`` groups of ``sp_size`` set up first."""
    if sp_size * dp_size > comm.get_world_size():
        raise ValueError(f"AutoSP's mesh of {sp_size} x {dp_size} ranks needs more than the {comm.get_world_size()} "
                         "ranks there are")
    sp_mesh.populate_registry(sp_size, dp_size)
    for edit in passes or AUTOSP_PASSES:
        edit(gm, real_inputs)
        if debug:
            log_dist(f"AutoSP after {edit.__name__}:\n{gm.print_readable(print_output=False)}", ranks=[0])


def init_autosp(sp_size: int, dp_size: int, backend: str = "inductor", debug: bool = False):
    """The dynamo backend (DeepSpeed's ``init_autosp``): the AutoSP passes, then ``backend`` (``inductor``, or
    ``eager``: the edited graph run as it is, autograd through its ops)."""
    if not required_torch_version(min_version=2.9):
        raise RuntimeError(f"AutoSP requires PyTorch >= 2.9, found {torch.__version__}")
    if backend not in ("inductor", "eager"):
        raise ValueError(f"AutoSP's backend is 'inductor' or 'eager', not {backend!r}")

    def backend_fn(gm: GraphModule, real_inputs: list):
        apply_autosp(gm, real_inputs, debug=debug, sp_size=sp_size, dp_size=dp_size)
        if backend == "eager":
            return gm
        return torch._inductor.compile(gm, real_inputs)

    return backend_fn
