"""Split a model's Transformer blocks over a tensor-parallel group for training.

Which linears pair up, which are column- and which row-parallel, how a fused projection (GPT-2's ``c_attn`` =
q|k|v) is cut part by part, and which head counts shrink is read from the module tree exactly as inference reads
it (:func:`dsrun.inference.auto_tp.check_split`: no per-architecture code; GPT-2's ``Conv1D``, Llama, Qwen2,
Mistral, OPT and dsrun's own GPT are read alike). Everything outside the pairs (embeddings, norms, the LM head,
a row-parallel linear's bias) stays whole on every rank.

:func:`split_for_training` cuts each pair's parameters in place (the same ``Parameter`` objects, this rank's
slice as their data) and returns a :class:`TPLayout`: for each split parameter, the dimension it was cut along
and the number of fused parts, which is all a checkpoint needs to put the ranks' slices back together
(:func:`dsrun.checkpoint.tensor_parallel.merge_module_states`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsrun.checkpoint.autotp_meta import collect_autotp_universal_checkpoint_info, mark_split
from dsrun.checkpoint.tensor_parallel import Parts, part_count, rank_widths, slice_dim
from dsrun.inference.auto_tp import (HEAD_DIM_ATTRS, block_linears, check_split, find_blocks, plan_model,
                                    split_head_attrs)
from dsrun.inference.groups import TPGroup
from dsrun.inference.layers import is_conv1d
from dsrun.utils.errors import ConfigError, Problem

from .layers import ColumnParallelLinear, RowParallelLinear
from .shard_sizes import by_kv_heads, grain_widths

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("DeepSpeed")


@dataclass
class TPLayout:
    """How a model was split: ``splits[name] = (dim, parts)`` for each split parameter (by state-dict name)."""

    tp_size: int
    tp_rank: int
    splits: dict[str, tuple[int, Parts]] = field(default_factory=dict)
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each split parameter's unsplit shape

    def record(self, name: str, param: torch.Tensor, dim: int, parts: Parts) -> None:
        """Note that ``param`` (still whole) is cut along ``dim`` in ``parts`` (a count of equal fused parts cut
        evenly, or the explicit widths: :data:`dsrun.checkpoint.tensor_parallel.Parts`)."""
        self.splits[name] = (dim, parts)
        self.whole[name] = tuple(param.shape)

    def entry(self) -> dict[str, object]:
        """The checkpoint entry (plain types)."""
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "splits": {name: list(cut) for name, cut in self.splits.items()}}


def head_dim_of(module: nn.Module) -> int | None:
    """The head width of an attention module (``head_dim`` ...), None for any other module."""
    return next((v for a in HEAD_DIM_ATTRS if isinstance(v := getattr(module, a, None), int) and v > 0), None)


def kv_head_shares(kv_heads: int, tp_size: int) -> tuple[int, ...]:
    """DeepSpeed's cut of ``kv_heads`` key/value heads over ``tp_size`` ranks (``tp_shard.get_shard_size`` with
    ``num_kv_heads`` set): as evenly as possible, the first ranks one more; a rank past the head count holds none."""
    return tuple(kv_heads // tp_size + (1 if rank < kv_heads % tp_size else 0) for rank in range(tp_size))


def uneven_kv_share(kv_heads: int | None, tp_size: int, tp_rank: int) -> tuple[int, int, int] | None:
    """This rank's key/value groups ``(first, count, total)`` when ``tp_size`` does not divide the model's
    ``kv_heads`` (DeepSpeed's uneven cut; warned, as DeepSpeed warns, when some ranks hold no heads), else None."""
    if not kv_heads or kv_heads % tp_size == 0:
        return None
    if tp_size > kv_heads:
        log.warning("AutoTP: autotp_size (%d) exceeds the model's key-value head count (%d); ranks beyond the head "
                    "count hold no attention shard and attention throughput will not scale past that point",
                    tp_size, kv_heads)
    shares = kv_head_shares(kv_heads, tp_size)
    return sum(shares[:tp_rank]), shares[tp_rank], kv_heads


def cut_widths(sizes: list[int], tp_size: int, head_dim: int | None, grain: int, where: str,
               kv_heads: int | None = None, name: str | None = None) -> Parts:
    """How a linear's split dimension, fused parts of ``sizes``, is cut over ``tp_size`` ranks: an attention
    module's projections (``head_dim`` known) on whole heads, each part's heads evenly; where ``tp_size`` does
    not divide a part's heads and the model's key/value head count ``kv_heads`` is known, DeepSpeed's cut by
    key/value groups (:func:`kv_head_shares`: 8 key/value heads over 3 ranks are 3/3/2, and each part, the query
    heads too, is cut in the same proportion; a rank past the head count holds no heads); a ConfigError when
    neither fits (a cut inside a head). The rest in grains of ``grain`` (``tensor_parallel.tp.tp_grain_size``,
    DeepSpeed's cut), a ConfigError when a rank would hold nothing of a part; except that, as DeepSpeed's
    ``get_shard_size`` does, a linear outside attention whose ``name`` (its module path) is not an MLP's or the LM
    head's, with every part a whole number of the model's ``kv_heads``, is cut by key/value groups too (6 groups of
    a 384-wide projection over 4 ranks: 128/128/64/64; the even cut whenever ``tp_size`` divides them). The count of
    parts when the cut is the even one (:func:`rank_widths`), else the widths."""
    by_groups = head_dim is None and kv_heads and name is not None and all(by_kv_heads(size, name, kv_heads)
                                                                           for size in sizes)
    if by_groups or head_dim is not None and kv_heads and all(size % (kv_heads * head_dim) == 0 for size in sizes):
        shares = kv_head_shares(kv_heads, tp_size)  # the even cut when tp_size divides the key/value heads
        widths = tuple(tuple(size // kv_heads * share for share in shares) for size in sizes)
        return len(sizes) if len(set(sizes)) == 1 and widths == rank_widths(sum(sizes), len(sizes), tp_size) \
            else widths
    if head_dim is not None and any(size % head_dim or (size // head_dim) % tp_size for size in sizes):
        size = next(size for size in sizes if size % head_dim or (size // head_dim) % tp_size)
        heads = f"{size // head_dim} heads of {head_dim}" if size % head_dim == 0 else \
            f"{size} features (not whole heads of {head_dim})"
        groups = f"nor into the model's {kv_heads} key/value groups" if kv_heads else \
            "and the model's config names no key/value head count"
        raise ConfigError(Problem(where, f"its {heads} do not split over tensor_parallel.autotp_size={tp_size} "
                                  f"({groups}; attention is cut on whole heads)",
                                  "pick an autotp_size that divides the attention and key/value heads"))
    widths = tuple(grain_widths(size, tp_size, head_dim or grain) for size in sizes)
    if any(0 in part for part in widths):
        what = "in grains of %d " % grain if head_dim is None and grain > 1 else ""
        raise ConfigError(Problem(where, f"its {sum(sizes)} features in {len(sizes)} part(s) cut {what}over "
                                  f"tp_size={tp_size} leave some ranks nothing", "a smaller tp_size or "
                                  "tp_grain_size"))
    if len(set(sizes)) == 1 and widths == rank_widths(sum(sizes), len(sizes), tp_size):
        return len(sizes)
    return widths


def model_num_kv_heads(model: nn.Module) -> int | None:
    """The model's key/value head count as DeepSpeed's ``AutoTP.get_model_num_kv_heads`` reads its config (its
    ``text_config`` when it has one): the first of ``multi_query_group_num``, ``num_kv_heads``,
    ``num_key_value_heads``, ``num_attention_heads``, ``n_heads``, ``attention_heads`` that is set."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for name in ("multi_query_group_num", "num_kv_heads", "num_key_value_heads", "num_attention_heads", "n_heads",
                 "attention_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# DeepSpeed's tensor_parallel.keep_module_on_host (its TensorParallel_Layer.keep_module_on_host), process-wide as
# DeepSpeed keeps it: where a cut slice goes (set_keep_module_on_host)
_KEEP_ON_HOST = False


def set_keep_module_on_host(value: bool) -> None:
    """DeepSpeed's ``TensorParallel_Layer.set_keep_module_on_host``: false (the default), each slice the split cuts
    is a tensor of its own on the accelerator (a copy: the whole weight it came from is not kept alive, and on
    a CUDA rank the slices are on the device as they are cut); true, a slice stays on the host where the model
    is, not copied (a cut along the first dimension is a view of the whole weight), until the engine moves the
    module to the device."""
    global _KEEP_ON_HOST
    _KEEP_ON_HOST = bool(value)


def keep_module_on_host() -> bool:
    return _KEEP_ON_HOST


def _placed(cut: torch.Tensor) -> torch.Tensor:
    """A cut slice where ``keep_module_on_host`` puts it (DeepSpeed's ``TensorParallel_Layer.move``; a meta
    tensor stays meta)."""
    if cut.is_meta or _KEEP_ON_HOST:
        return cut
    from dsrun.accelerator import get_accelerator

    return cut.to(get_accelerator().current_device_name(), copy=True)


def cut_parameter(param: nn.Parameter, dim: int, parts: Parts, tp: TPGroup) -> None:
    """Keep this rank's slice of ``param`` (in place, placed as ``keep_module_on_host`` says) and mark it split,
    as Megatron marks it."""
    with torch.no_grad():
        param.data = _placed(slice_dim(param.data, dim, parts, tp.rank, tp.size))
    # Megatron's marks, which DeepSpeed's is_model_parallel_parameter reads; the explicit widths, when not even
    param.tensor_model_parallel = True
    param.partition_dim, param.partition_stride = dim, part_count(parts)
    param.partition_widths = None if isinstance(parts, int) else parts


POLICY_KEY = "tensor_parallel.injection_policy_tuple"


def injection_policy(model: nn.Module, rows: tuple[str, ...] | None) -> dict[type, tuple[str, ...]] | None:
    """DeepSpeed's injection policy tuple applied to every block the reading finds: ``rows`` names each block's
    row-parallel (all-reduced) linears, by their path in the block or its tail (``attn.c_proj``, ``c_proj``); the
    block's other linears are column-parallel. None when ``rows`` is None. A name that matches no linear of any
    block is a ConfigError (DeepSpeed's "Injection policy layer ... not valid")."""
    if rows is None:
        return None
    blocks = find_blocks(model)
    names = {name for _, block in blocks for name, *_ in block_linears(block)}
    for row in rows:
        if not any(name == row or name.endswith("." + row) for name in names):
            raise ConfigError(Problem(POLICY_KEY, f"{row!r} names no linear of the model's blocks (they hold "
                                      f"{', '.join(sorted(names)) or 'none'})", "name each block's row-parallel "
                                      "linears by their path in the block, e.g. 'attn.c_proj'"))
    return {type(block): rows for _, block in blocks}


def split_for_training(model: nn.Module, group: ProcessGroup | None, tp_rank: int, tp_size: int,
                       grain: int = 1, rows: tuple[str, ...] | None = None) -> TPLayout:
    """Replace each pair's linears by this rank's column-/row-parallel slices (in place, keeping the
    parameters); raises ConfigError when a block does not split over ``tp_size``. Attention is cut on whole
    heads, the MLP in grains of ``grain`` (:func:`cut_widths`); when ``tp_size`` does not divide the model's
    key/value heads, by DeepSpeed's key/value groups (the head counts scaled to this rank's share). ``rows``:
    the config's ``injection_policy_tuple``, each block's row-parallel linears (:func:`injection_policy`)
    instead of the automatic reading's."""
    tp = TPGroup(group, tp_rank, tp_size)
    kv_heads = model_num_kv_heads(model)
    share = uneven_kv_share(kv_heads, tp_size, tp_rank)
    policy = injection_policy(model, rows)
    # DeepSpeed's uneven cut by key/value groups: cut_widths checks each cut
    plans = check_split(model, tp_size, policy) if share is None else plan_model(model, policy)
    layout = TPLayout(tp_size, tp_rank)
    for plan in plans:
        attention: dict[int, tuple[nn.Module, str]] = {}
        for pair in plan.pairs:
            for slot, row in [(c, False) for c in pair.columns] + [(pair.row, True)]:
                module = slot.module
                transposed = is_conv1d(module)
                out_dim = 1 if transposed else 0
                dim = (1 - out_dim) if row else out_dim
                prefix = f"{plan.name}.{slot.name}"
                length = module.weight.shape[dim]
                count = 1 if row else slot.parts
                parts = cut_widths([length // count] * count, tp_size,
                                   head_dim_of(slot.parent) if pair.attention else None, grain, prefix, kv_heads,
                                   name=prefix)
                layout.record(f"{prefix}.weight", module.weight, dim, parts)
                cut_parameter(module.weight, dim, parts, tp)
                if module.bias is not None and not row:
                    layout.record(f"{prefix}.bias", module.bias, 0, parts)
                    cut_parameter(module.bias, 0, parts, tp)
                kind = RowParallelLinear if row else ColumnParallelLinear
                replacement = kind(module.weight, module.bias, transposed, group, tp_size, tp_rank, name=prefix)
                setattr(slot.parent, slot.attr, replacement)
                slot.module = replacement
                if not row and pair.attention:
                    attention[id(slot.parent)] = (slot.parent, f"{plan.name}.{slot.name}")
        for module, where in attention.values():
            split_head_attrs(module, tp, where.rsplit(".", 1)[0], share)
    return layout


def split_meta_model(model: nn.Module, tp_size: int, grain: int = 1, rows: tuple[str, ...] | None = None) -> None:
    """Split a meta-device model in place as rank 0 of a tensor-parallel group of ``tp_size`` splits it (every
    rank's share has the same shapes): what the memory estimator counts as one rank's model
    (:func:`dsrun.estimate.runspec.build_recipe_model`'s ``split``). No group is needed: nothing is
    communicated until a forward."""
    split_for_training(model, None, 0, tp_size, grain, rows)


def universal_checkpoint_info(model: nn.Module, layout: TPLayout) -> dict[str, object]:
    """DeepSpeed's model-level ``universal_checkpoint_info`` of a split model: each split parameter of ``layout``
    is marked with DeepSpeed's per-parameter metadata (:func:`dsrun.checkpoint.autotp_meta.mark_split`: its
    dimension, whole shape, each rank's widths per fused part, row or column), then
    :func:`~dsrun.checkpoint.autotp_meta.collect_autotp_universal_checkpoint_info` reads the model (the row-parallel
    weights, the parameters every rank holds whole, the vocabulary-cut ones with the vocabulary size, the fused
    ones with their widths; dsrun's own conversion reads the checkpoint's ``tensor_parallel`` entry instead)."""
    params = dict(model.named_parameters())
    for name, (dim, parts) in layout.splits.items():
        param = params.get(name)
        if param is None:
            continue
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        whole = layout.whole[name]
        row = bool(getattr(owner, "row_parallel", False)) or isinstance(owner, nn.Embedding)  # its hidden columns
        mark_split(param, row=row, dim=dim, whole_shape=whole,
                   widths=rank_widths(whole[dim], parts, layout.tp_size), is_bias=name.endswith(".bias"))
    return collect_autotp_universal_checkpoint_info(model)
