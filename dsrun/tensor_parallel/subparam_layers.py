"""DeepSpeed's AutoTP layers for fused weights (``deepspeed.module_inject.layers``): a weight that holds several
logical sub-parameters (a fused q|k|v, a packed gate|up) is cut sub-parameter by sub-parameter, so each rank holds
its piece of every part, concatenated.

* ``SubParamLinearLayer(module, mp_group, shape, partition_dim=0, name=...)``: column-parallel. ``shape`` views the
  weight logically (its last entry is the input features): ``(3, -1)`` three equal parts, ``((q, k, v), -1)``
  parts of those sizes; the partition dimension is cut part by part with DeepSpeed's shard sizes
  (:func:`dsrun.tensor_parallel.shard_sizes.get_shard_size_list`: whole key/value heads when their number is set,
  so a fused attention weight is cut on head boundaries). The bias follows the output dimensions.
* ``SubParamLinearAllreduce(module, mp_group, shape, partition_dim=1, ...)``: row-parallel, the input features cut
  the same way, the partial outputs all-reduced, the whole bias added once.
* ``SubParamColumnParallel``: DeepSpeed's base for ``LinearLayer`` subclasses that cut a fused weight per
  sub-parameter (``_subparam_layout_spec = (sizes, shard_name)``); ``GateUpPack_LinearLayer`` (ChatGLM's packed
  gate|up: two halves, cut as MLP weights) and ``fused_LinearLayer`` (a model's fused q|k|v, its layout read from
  the block's class: BLOOM/Falcon one block, GLM/MPT/Baichuan/QWen thirds (ChatGLM's two key/value heads: q, k, v of
  their own sizes), Phi-3 q|k|v by its heads) are its subclasses.

Each layer records ``_subparam_sizes``, ``_subparam_shard_widths`` (per part, every rank's width), the original
shapes; ``gather_params(params)`` puts the whole tensor back (collective over the group) by those widths, and
``_tp_partition(params)`` cuts this rank's pieces again; the bias is told apart by identity, as in DeepSpeed. The
forward and backward are dsrun's column-/row-parallel ones (:mod:`dsrun.tensor_parallel.layers`). Each records
DeepSpeed's universal-checkpoint metadata at construction (``_mark_uc_metadata``). CodeGen's interleaved and
GPT-BigCode's replicated q|k|v layouts are built only whole (their cut over several ranks is refused in one line),
their metadata recording why no merge undoes them. A column layer may name the input dimension only when built on
one rank (DeepSpeed's metadata-only build).
"""
from __future__ import annotations

import logging
from math import prod
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from dsrun.checkpoint.autotp_meta import DS_AUTOTP_UC_META, _build_param_uc_restore_meta

from .deepspeed_layers import LinearLayer, _group_rank_size, _subparam_shard_widths
from .layers import ColumnParallelLinear, RowParallelLinear, gather_slices
from .shard_sizes import get_n_embd, get_num_attention_heads, get_num_kv_heads, get_shard_size_list

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("DeepSpeed")

ShapeSpec = Sequence[Any]


def _label(name: str | None) -> str:
    return f"AutoTP layer '{name}'" if name else "AutoTP layer"


def _as_tuple(shape: object) -> object:
    if isinstance(shape, (list, tuple)):
        return tuple(_as_tuple(item) for item in shape)
    return shape


def infer_subparam_logical_shapes(weight_shape: Sequence[int], shape: ShapeSpec, partition_dim: int,
                                  name: str | None = None
                                  ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None, int | None]:
    """DeepSpeed's reading of a ``shape`` spec against a 2-D weight: the logical shape, its output part (all but
    the last, input, dimension), the sub-parameter sizes along ``partition_dim`` (None: one part) and the
    dimension the bias is cut along (None for a cut of the input). A ValueError, naming the layer, for a spec
    that does not describe the weight."""
    label = _label(name)
    shape = _as_tuple(shape)
    if not isinstance(shape, tuple):
        raise ValueError(f"{label}: shape must be a tuple for sub-parameter partitioning.")
    if not 0 <= partition_dim < len(shape):
        raise ValueError(f"{label}: partition_dim {partition_dim} is out of range for shape length {len(shape)}.")
    sizes: tuple[int, ...] | None = None
    count = None
    cut = shape[partition_dim]
    if isinstance(cut, tuple):
        if not cut or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in cut):
            raise ValueError(f"{label}: sub-parameter sizes must be a non-empty tuple of positive integers "
                             "(one level of nesting).")
        sizes = tuple(cut)
    elif isinstance(cut, int) and (cut == -1 or cut > 0):
        count = cut if cut > 0 else None
    else:
        raise ValueError(f"{label}: the partition_dim entry of shape must be a positive integer, -1 or a tuple.")
    dims: list[int | None] = []
    for index, dim in enumerate(shape):
        if index == partition_dim:
            dims.append(sum(sizes) if sizes else None)
        elif isinstance(dim, tuple):
            raise ValueError(f"{label}: nested tuple only allowed at partition_dim={partition_dim}.")
        elif isinstance(dim, int) and (dim == -1 or dim > 0):
            dims.append(None if dim == -1 else dim)
        else:
            raise ValueError(f"{label}: shape dimensions must be positive integers or -1.")
    total = prod(weight_shape)
    unknown = [i for i, d in enumerate(dims) if d is None]
    known = prod(d for d in dims if d is not None)
    if len(unknown) == 1:
        dims[unknown[0]] = total // known
    elif len(unknown) > 1 and len(shape) == len(weight_shape):
        for i in unknown:
            dims[i] = weight_shape[i]
    elif unknown:
        raise ValueError(f"{label}: shape has several inferred dimensions and is ambiguous for the weight.")
    logical = tuple(int(d) for d in dims)  # type: ignore[arg-type]
    if prod(logical) != total or logical[-1] != weight_shape[-1] or len(logical) < 2:
        raise ValueError(f"{label}: shape {list(shape)} does not describe the weight {list(weight_shape)} "
                         "(its last dimension is the input features)")
    if count is not None:
        if logical[partition_dim] % count:
            raise ValueError(f"{label}: partition_dim size {logical[partition_dim]} is not divisible by "
                             f"sub-param count {count}.")
        sizes = (logical[partition_dim] // count,) * count
    output = logical[:-1]
    return logical, output, sizes, (partition_dim if partition_dim < len(output) else None)


def subparam_shard_widths(sizes: Sequence[int], tp_size: int, name: str | None = None) -> list[list[int]]:
    """Each sub-parameter's per-rank widths, each cut by DeepSpeed's shard sizes (a rank may hold none of a part
    when there are fewer heads than ranks: logged once, as DeepSpeed warns)."""
    widths = _subparam_shard_widths(sizes, tp_size, name)
    if any(0 in part for part in widths):
        log.warning("AutoTP: a sub-parameter of %s splits over %d ranks as %s, so some ranks hold none of it",
                    name, tp_size, widths)
    return widths


def partition_logical(tensor: torch.Tensor, dim: int, widths: list[list[int]], rank: int) -> torch.Tensor:
    """This rank's piece of each sub-parameter of ``tensor`` (already in its logical shape) along ``dim``,
    concatenated."""
    parts = tensor.split([sum(part) for part in widths], dim=dim)
    return torch.cat([part.split(width, dim=dim)[rank] for part, width in zip(parts, widths)], dim=dim)


def gather_logical(local: torch.Tensor, shape: Sequence[int], dim: int, widths: list[list[int]], rank: int,
                   group: ProcessGroup | None) -> torch.Tensor:
    """The whole tensor (in ``shape``) from every rank's pieces of each sub-parameter along ``dim``; collective
    over ``group``."""
    size = len(widths[0])
    mine = list(shape)
    mine[dim] = sum(part[rank] for part in widths)
    pieces = local.reshape(mine).split([part[rank] for part in widths], dim=dim)
    whole = [torch.cat(gather_slices(piece.contiguous(), dim, group, size), dim=dim) for piece in pieces]
    return torch.cat(whole, dim=dim)


class _SubParamShards:
    """What the sub-parameter layers share: the cut of a parameter in its logical shape, its gather, the marks."""

    name: str | None
    group: ProcessGroup | None
    tp_rank: int
    tp_world_size: int
    bias: nn.Parameter | None
    _logical_shape: tuple[int, ...]
    _output_shape: tuple[int, ...]
    _subparam_sizes: tuple[int, ...] | None
    _subparam_shard_widths: list[list[int]]
    _bias_partition_dim: int | None
    _orig_weight_shape: tuple[int, ...]
    _orig_bias_shape: tuple[int, ...] | None
    partition_dim: int

    @property
    def tp_index(self) -> int:  # DeepSpeed's name for this rank's place in the group
        return self.tp_rank

    @tp_index.setter
    def tp_index(self, value: int) -> None:
        self.tp_rank = value

    def _mark_uc_metadata(self) -> None:
        """Each parameter's universal-checkpoint metadata, as DeepSpeed's sub-parameter layers record it: the weight
        cut along ``partition_dim`` of its logical shape, the view spec as given, the sub-parameters' sizes and
        per-rank widths; the bias along its own cut dimension with a resolved spec, or whole (replicated) when the
        input is cut."""
        row = isinstance(self, RowParallelLinear)
        widths = [list(part) for part in self._subparam_shard_widths]
        setattr(self.weight, DS_AUTOTP_UC_META, _build_param_uc_restore_meta(
            partition_type="row" if row else "column", partition_dim=self.partition_dim,
            logical_shape=self._logical_shape, output_shape=self._output_shape, sub_param_shape=self.shape,
            sub_param_sizes=self._subparam_sizes, sub_param_shard_widths=widths,
            target_partition_shape=tuple(self.weight.shape), original_shape=self._orig_weight_shape))
        if self.bias is None:
            return
        dim = self._bias_partition_dim
        spec = None
        if dim is not None:
            spec = list(self._output_shape)
            if self._subparam_sizes is not None:
                spec[dim] = tuple(self._subparam_sizes)
            spec = tuple(spec)
        setattr(self.bias, DS_AUTOTP_UC_META, _build_param_uc_restore_meta(
            partition_type="row" if row else "column", partition_dim=dim, logical_shape=self._output_shape,
            output_shape=self._output_shape, sub_param_shape=spec,
            sub_param_sizes=self._subparam_sizes if dim is not None else None,
            sub_param_shard_widths=widths if dim is not None else None, target_partition_shape=tuple(self.bias.shape),
            original_shape=self._orig_bias_shape, is_bias=True, replicated=dim is None))

    def _is_bias_param(self, param: torch.Tensor) -> bool:
        return self.bias is not None and param is self.bias

    def _view(self, is_bias: bool) -> tuple[tuple[int, ...], int | None]:
        """The logical shape a weight (or the bias) is cut in, and its cut dimension (None: whole on every rank)."""
        return (self._output_shape, self._bias_partition_dim) if is_bias else (self._logical_shape, self.partition_dim)

    def _cut_param(self, param: torch.Tensor, is_bias: bool) -> None:
        shape, dim = self._view(is_bias)
        if dim is None:
            return
        if self.tp_world_size > 1:
            with torch.no_grad():
                piece = partition_logical(param.data.reshape(shape), dim, self._subparam_shard_widths, self.tp_rank)
                param.data = piece.reshape(-1) if is_bias else piece.reshape(prod(piece.shape[:-1]), piece.shape[-1])
        if isinstance(param, nn.Parameter):  # Megatron's marks, and the explicit widths dsrun's merges read
            param.tensor_model_parallel = True
            param.partition_dim = 0 if is_bias or dim < len(self._output_shape) else 1
            param.partition_stride = len(self._subparam_shard_widths)
            param.partition_widths = tuple(tuple(part) for part in self._subparam_shard_widths)

    def gather_params(self, params_list: list[torch.Tensor | None]) -> None:
        """Put each parameter of ``params_list`` back whole, sub-parameter by sub-parameter (collective over the
        group); a row-parallel bias is whole already. The bias is told apart from a weight by identity."""
        for param in params_list:
            if param is None or self.tp_world_size == 1:
                continue
            is_bias = self._is_bias_param(param)
            shape, dim = self._view(is_bias)
            if dim is None:
                continue
            whole = self._orig_bias_shape if is_bias else self._orig_weight_shape
            with torch.no_grad():
                full = gather_logical(param.data, shape, dim, self._subparam_shard_widths, self.tp_rank, self.group)
                param.data = full.reshape(whole).contiguous()  # type: ignore[arg-type]

    def _tp_partition(self, params_list: list[torch.Tensor | None]) -> None:
        """Cut each (whole) parameter of ``params_list`` back to this rank's pieces."""
        for param in params_list:
            if param is not None:
                self._cut_param(param, self._is_bias_param(param))

    def _setup(self, module: nn.Module, mp_group: ProcessGroup | None, shape: ShapeSpec, partition_dim: int,
               kwargs: dict[str, object]) -> None:
        rank, size = _group_rank_size(mp_group)
        self.tp_rank, self.tp_world_size = int(kwargs.get("tp_rank", rank)), int(kwargs.get("tp_size", size))
        self.name, self.shape, self.partition_dim = kwargs.get("name"), _as_tuple(shape), partition_dim
        weight, bias = module.weight, getattr(module, "bias", None)
        self._orig_weight_shape = tuple(weight.shape)
        self._orig_bias_shape = tuple(bias.shape) if bias is not None else None
        (self._logical_shape, self._output_shape, self._subparam_sizes,
         self._bias_partition_dim) = infer_subparam_logical_shapes(self._orig_weight_shape, shape, partition_dim,
                                                                   self.name)
        if bias is not None and bias.numel() != prod(self._output_shape):
            raise ValueError(f"{_label(self.name)}: bias size {bias.numel()} does not match the output shape "
                             f"{self._output_shape}.")
        sizes = self._subparam_sizes or (self._logical_shape[partition_dim],)
        given = kwargs.get("subparam_shard_widths")  # dsrun's split by rules: its own (head-aware) cut
        self._subparam_shard_widths = [list(part) for part in given] if given is not None else \
            subparam_shard_widths(sizes, self.tp_world_size, self.name)
        self._cut_param(weight, False)
        if bias is not None:
            self._cut_param(bias, True)


class SubParamLinearLayer(_SubParamShards, ColumnParallelLinear):
    """DeepSpeed's column-parallel ``SubParamLinearLayer``: this rank's piece of every sub-parameter of the output
    features (and of the bias)."""

    def __init__(self, module: nn.Module, mp_group: ProcessGroup | None, shape: ShapeSpec, partition_dim: int = 0,
                 **kwargs: object):
        _, size = _group_rank_size(mp_group)
        if partition_dim >= len(_as_tuple(shape)) - 1 and int(kwargs.get("tp_size", size)) > 1:
            raise ValueError(f"{_label(kwargs.get('name'))}: a column-parallel sub-parameter layer cuts an output "
                             f"dimension over more than one rank; partition_dim {partition_dim} is the input (use "
                             "SubParamLinearAllreduce)")
        self._setup(module, mp_group, shape, partition_dim, kwargs)
        ColumnParallelLinear.__init__(self, module.weight, getattr(module, "bias", None), False, mp_group,
                                      self.tp_world_size, self.tp_rank)
        self._mark_uc_metadata()


class SubParamLinearAllreduce(_SubParamShards, RowParallelLinear):
    """DeepSpeed's row-parallel ``SubParamLinearAllreduce``: this rank's piece of every sub-parameter of the input
    features; the partial outputs are all-reduced, then the whole bias is added."""

    def __init__(self, module: nn.Module, mp_group: ProcessGroup | None, shape: ShapeSpec, partition_dim: int = 1,
                 **kwargs: object):
        if partition_dim != len(_as_tuple(shape)) - 1:
            raise ValueError(f"{_label(kwargs.get('name'))}: a row-parallel sub-parameter layer cuts the input "
                             f"features (the last dimension of shape), not dimension {partition_dim}")
        self._setup(module, mp_group, shape, partition_dim, kwargs)
        RowParallelLinear.__init__(self, module.weight, getattr(module, "bias", None), False, mp_group,
                                   self.tp_world_size, self.tp_rank)
        self._mark_uc_metadata()


class SubParamColumnParallel(LinearLayer):
    """DeepSpeed's base of the ``LinearLayer`` subclasses that cut a fused weight per sub-parameter: a subclass sets
    ``_subparam_layout_spec = (sizes, shard_name)`` before this constructor runs (``shard_name`` is the name the
    shard sizes are asked with: ``"mlp"`` cuts evenly, not by heads). ``sizes`` None is a layout no per-part
    description fits (interleaved or replicated blocks): such a layer is built only whole (one rank, or
    ``skip_partition``), its metadata records ``_unsupported_uc_reason`` and ``gather_params`` refuses."""

    _subparam_layout_spec: tuple[tuple[int, ...] | None, str | None]
    _unsupported_uc_reason = "its tensor parallel layout cannot be described per sub-parameter"

    def __init__(self, module: nn.Linear, mp_group: ProcessGroup | None, skip_partition: bool = False,
                 **kwargs: object):
        if kwargs.get("gather_output"):
            raise ValueError(f"{_label(kwargs.get('name'))}: gather_output with fused sub-parameters is not built "
                             "(nor in DeepSpeed)")
        sizes, shard_name = self._subparam_layout_spec
        _, size = _group_rank_size(mp_group)
        size = 1 if skip_partition else int(kwargs.get("tp_size", size))
        self._orig_weight_shape = tuple(module.weight.shape)
        self._orig_bias_shape = tuple(module.bias.shape) if module.bias is not None else None
        if sizes is None and size > 1:
            raise ValueError(f"{_label(kwargs.get('name'))}: {self._unsupported_uc_reason}; this layout is not cut "
                             "(build it with skip_partition=True, or give partition_config a shape for it)")
        self._set_subparam_widths(size)
        super().__init__(module, mp_group, skip_partition, **{**kwargs, "shard_sizes": self._per_rank()})

    def _set_subparam_widths(self, size: int) -> None:
        sizes, shard_name = self._subparam_layout_spec
        self._subparam_sizes = tuple(sizes) if sizes is not None else None
        self._subparam_shard_widths = subparam_shard_widths(sizes, size, shard_name) if sizes is not None else None

    def _per_rank(self) -> list[int]:
        if self._subparam_shard_widths is None:
            return [self._orig_weight_shape[0]]
        return [sum(part[r] for part in self._subparam_shard_widths) for r in range(len(self._subparam_shard_widths[0]))]

    def _freeze_partition_sizes(self, total_size: int) -> tuple[int, ...]:
        """The sub-parameters' widths over the current ``tp_world_size``, resolved once (DeepSpeed's)."""
        self._set_subparam_widths(self.tp_world_size)
        self._partition_sizes = tuple(self._per_rank()) if self._subparam_sizes is not None else \
            tuple(get_shard_size_list(total_size, self.tp_world_size, self.name))
        self.shard_sizes = list(self._partition_sizes)
        return self._partition_sizes

    def _cut(self, param: nn.Parameter, dim: int) -> None:
        if len(self.shard_sizes) > 1:
            with torch.no_grad():
                param.data = partition_logical(param.data, 0, self._subparam_shard_widths, self.tp_rank).contiguous()
        param.tensor_model_parallel = True
        param.partition_dim, param.partition_stride = 0, len(self._subparam_sizes or (0,))

    def _mark_uc_metadata(self) -> None:
        """Each parameter's universal-checkpoint metadata: cut along dim 0 sub-parameter by sub-parameter, with each
        one's per-rank widths and the whole sizes in the other dimensions (not LinearLayer's plain cut, which a
        merge would put back in rank order); a layout without sub-parameters records why it cannot be converted."""
        for param, whole in ((self.weight, self._orig_weight_shape), (self.bias, self._orig_bias_shape)):
            if param is None or whole is None:
                continue
            if self._subparam_sizes is None:
                meta = _build_param_uc_restore_meta(partition_type="column", partition_dim=0, logical_shape=whole,
                                                    original_shape=whole, is_bias=param is self.bias,
                                                    unsupported_reason=self._unsupported_uc_reason)
            else:
                spec = (tuple(self._subparam_sizes),) + tuple(whole[1:])
                meta = _build_param_uc_restore_meta(
                    partition_type="column", partition_dim=0, logical_shape=whole, output_shape=(whole[0],),
                    sub_param_shape=spec, sub_param_sizes=self._subparam_sizes,
                    sub_param_shard_widths=[list(part) for part in self._subparam_shard_widths],
                    target_partition_shape=tuple(param.shape), original_shape=whole, is_bias=param is self.bias)
            setattr(param, DS_AUTOTP_UC_META, meta)

    def gather_params(self, params_list: list[torch.Tensor | None]) -> None:
        """Each parameter of ``params_list`` back whole, sub-parameter by sub-parameter (not in rank order)."""
        if self._subparam_sizes is None:
            raise RuntimeError(self._unsupported_uc_reason)
        for param in params_list:
            if param is None or len(self.shard_sizes) == 1:
                continue
            whole = self._orig_bias_shape if param is self.bias else self._orig_weight_shape
            with torch.no_grad():
                param.data = gather_logical(param.data, whole, 0, self._subparam_shard_widths, self.tp_rank,
                                            self.group).contiguous()

    def _tp_partition(self, params_list: list[torch.Tensor | None]) -> None:
        if self._subparam_sizes is None:
            raise RuntimeError(self._unsupported_uc_reason)
        for param in params_list:
            if param is not None and len(self.shard_sizes) > 1:
                with torch.no_grad():
                    param.data = partition_logical(param.data, 0, self._subparam_shard_widths,
                                                   self.tp_rank).contiguous()


class GateUpPack_LinearLayer(SubParamColumnParallel):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's layer for a packed gate|up projection (ChatGLM2/3): the two halves each cut as an MLP weight."""

    def __init__(self, module: nn.Linear, mp_group: ProcessGroup | None = None, **kwargs: object):
        half = module.weight.shape[0] // 2
        self._subparam_layout_spec = ((half, half), "mlp")
        super().__init__(module, mp_group, **kwargs)


# DeepSpeed's fused q|k|v layouts, by the class name of the block that holds the projection
_FUSED_QKV_TYPES = {"CodeGenBlock": "codegentype", "BloomBlock": "bloomtype", "GLMBlock": "glmtype",
                    "MPTBlock": "glmtype", "MptBlock": "glmtype", "BaichuanLayer": "glmtype", "QWenBlock": "qwentype",
                    "FalconDecoderLayer": "bloomtype", "GPTBigCodeBlock": "bigcodetype", "DecoderLayer": "glmtype",
                    "Phi3DecoderLayer": "phi3type"}


def fused_qkv_type(module: nn.Module) -> str | None:
    """DeepSpeed's ``get_fused_qkv_type``: the layout of the block's fused q|k|v (the longest class name found in
    the module's text), None when unknown."""
    text = str(module).strip()
    names = [name for name in _FUSED_QKV_TYPES if name in text]
    return _FUSED_QKV_TYPES[max(names, key=len)] if names else None


def fused_qkv_subparam_sizes(module: nn.Module, weight_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The sub-parameters a fused q|k|v of ``weight_shape`` is cut into (DeepSpeed's ``fused_qkv_subparam_sizes``):
    one block (BLOOM, Falcon, an unknown block), thirds (GLM, MPT, Baichuan, QWen; ChatGLM's two key/value heads:
    the hidden size, then two equal key/value parts), Phi-3's q|k|v by its heads; None for the layouts that
    interleave or replicate blocks (CodeGen, GPT-BigCode)."""
    kind = fused_qkv_type(module) or "bloomtype"
    total = weight_shape[0]
    if kind == "bloomtype":
        return (total,)
    if kind in ("glmtype", "qwentype"):
        if get_num_kv_heads() == 2:
            hidden = get_n_embd()
            if hidden is None:
                raise ValueError("fused_LinearLayer: ChatGLM's fused q|k|v needs the hidden size (tp_shard.set_n_embd)")
            kv = (total - hidden) // 2
            return (hidden, kv, kv)
        return (total // 3,) * 3
    if kind == "phi3type":
        heads, kv_heads = get_num_attention_heads(), get_num_kv_heads()
        if not heads or not kv_heads:
            raise ValueError("fused_LinearLayer: Phi-3's fused q|k|v needs the head counts (tp_shard.set_num_attention_"
                             "heads, set_num_kv_heads)")
        kv = kv_heads * (weight_shape[1] // heads)
        return (total - 2 * kv, kv, kv)
    return None


class FusedModuleWrapper:
    """DeepSpeed's wrapper that keeps the fused block out of the layer's submodules (no reference cycle): any
    attribute read returns the block."""

    def __init__(self, fused_module: nn.Module):
        self.fused_module = fused_module

    def __getattr__(self, name: str) -> nn.Module:
        return self.fused_module


class fused_LinearLayer(SubParamColumnParallel):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's column-parallel layer of a model's fused q|k|v projection (``fused_module=`` the block holding
    it): each of q, k and v cut on its own, as its layout says (:func:`fused_qkv_subparam_sizes`); QWen's
    ``attn.split_size`` becomes this rank's query width. CodeGen's and GPT-BigCode's layouts are refused."""

    def __init__(self, module: nn.Linear, mp_group: ProcessGroup | None, skip_partition: bool = False,
                 **kwargs: object):
        block = kwargs.pop("fused_module", None)
        if block is None:
            raise ValueError("fused_LinearLayer: 'fused_module' (the block holding the fused q|k|v) is required")
        self.fused_module = FusedModuleWrapper(block)
        sizes = fused_qkv_subparam_sizes(block, tuple(module.weight.shape))
        self._subparam_layout_spec = (sizes, None)
        if sizes is None:
            self._unsupported_uc_reason = (f"the {fused_qkv_type(block)} fused qkv layout interleaves or replicates "
                                           "blocks across tensor parallel ranks, so the original parameter cannot be "
                                           "reassembled from the shards")
        super().__init__(module, mp_group, skip_partition, **kwargs)
        if fused_qkv_type(block) == "qwentype" and not skip_partition:
            width = self._subparam_shard_widths[0][self.tp_rank]
            if width == 0:
                raise ValueError(f"fused_LinearLayer: QWen's attention over {len(self.shard_sizes)} ranks leaves rank "
                                 f"{self.tp_rank} no query columns; use a smaller tensor-parallel size")
            block.attn.split_size = width
