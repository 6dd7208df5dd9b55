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

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsrun.checkpoint import constants
from dsrun.checkpoint.tensor_parallel import slice_dim
from dsrun.inference.auto_tp import check_split, split_head_attrs
from dsrun.inference.groups import TPGroup
from dsrun.inference.layers import is_conv1d

from .layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class TPLayout:
    """How a model was split: ``splits[name] = (dim, parts)`` for each split parameter (by state-dict name)."""

    tp_size: int
    tp_rank: int
    splits: dict[str, tuple[int, int]] = field(default_factory=dict)
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each split parameter's unsplit shape

    def record(self, name: str, param: torch.Tensor, dim: int, parts: int) -> None:
        """Note that ``param`` (still whole) is cut along ``dim`` in ``parts`` fused parts."""
        self.splits[name] = (dim, parts)
        self.whole[name] = tuple(param.shape)

    def entry(self) -> dict[str, object]:
        """The checkpoint entry (plain types)."""
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "splits": {name: list(cut) for name, cut in self.splits.items()}}


def cut_parameter(param: nn.Parameter, dim: int, parts: int, tp: TPGroup) -> None:
    """Keep this rank's slice of ``param`` (in place) and mark it split, as Megatron marks it."""
    with torch.no_grad():
        param.data = slice_dim(param.data, dim, parts, tp.rank, tp.size)
    # Megatron's marks, which DeepSpeed's is_model_parallel_parameter reads
    param.tensor_model_parallel = True
    param.partition_dim, param.partition_stride = dim, parts


def split_for_training(model: nn.Module, group: ProcessGroup | None, tp_rank: int, tp_size: int) -> TPLayout:
    """Replace each pair's linears by this rank's column-/row-parallel slices (in place, keeping the
    parameters); raises ConfigError when a block does not split over ``tp_size``."""
    tp = TPGroup(group, tp_rank, tp_size)
    plans = check_split(model, tp_size)
    layout = TPLayout(tp_size, tp_rank)
    for plan in plans:
        attention: dict[int, tuple[nn.Module, str]] = {}
        for pair in plan.pairs:
            for slot, row in [(c, False) for c in pair.columns] + [(pair.row, True)]:
                module = slot.module
                transposed = is_conv1d(module)
                out_dim = 1 if transposed else 0
                dim = (1 - out_dim) if row else out_dim
                parts = 1 if row else slot.parts
                prefix = f"{plan.name}.{slot.name}"
                layout.record(f"{prefix}.weight", module.weight, dim, parts)
                cut_parameter(module.weight, dim, parts, tp)
                if module.bias is not None and not row:
                    layout.record(f"{prefix}.bias", module.bias, 0, parts)
                    cut_parameter(module.bias, 0, parts, tp)
                kind = RowParallelLinear if row else ColumnParallelLinear
                replacement = kind(module.weight, module.bias, transposed, group, tp_size, tp_rank)
                setattr(slot.parent, slot.attr, replacement)
                slot.module = replacement
                if not row and pair.attention:
                    attention[id(slot.parent)] = (slot.parent, f"{plan.name}.{slot.name}")
        for module, where in attention.values():
            split_head_attrs(module, tp, where.rsplit(".", 1)[0])
    return layout


def split_meta_model(model: nn.Module, tp_size: int) -> None:
    """Split a meta-device model in place as rank 0 of a tensor-parallel group of ``tp_size`` splits it (every
    rank's share has the same shapes): what the memory estimator counts as one rank's model
    (:func:`dsrun.estimate.runspec.build_recipe_model`'s ``split``). No group is needed: nothing is
    communicated until a forward."""
    split_for_training(model, None, 0, tp_size)


def universal_checkpoint_info(model: nn.Module, layout: TPLayout) -> dict[str, object]:
    """DeepSpeed's model-level ``universal_checkpoint_info`` of a split model (the schema DeepSpeed's
    ``ds_to_universal`` reads; dsrun's conversion reads the checkpoint's own ``tensor_parallel`` entry instead): the
    row-parallel weights, the parameters every rank holds whole (row biases, norms, embeddings), the vocabulary-cut
    ones (an LM head's or embedding's rows) with the whole vocabulary size, and the fused ones with the widths of
    their parts; each by a ``^name$`` pattern of its first name (a tied parameter is named once)."""
    first = {id(p): n for n, p in model.named_parameters()}
    rows, whole, vocab, fused, vocab_size = [], [], [], [], None
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            if first.get(id(param)) != name:
                continue
            pattern = f"^{re.escape(name)}$"
            if name not in layout.splits:
                whole.append(pattern)
                continue
            dim, parts = layout.splits[name]
            if getattr(module, "row_parallel", False) and attr == "weight":
                rows.append(pattern)
            full = layout.whole[name][dim]
            if dim == 0 and parts == 1 and len(layout.whole[name]) == 2 and ("embed" in name or "lm_head" in name):
                vocab.append(pattern)
                vocab_size = full if vocab_size is None else vocab_size
            if parts > 1:
                shape: list[object] = [-1] * len(layout.whole[name])
                shape[dim] = tuple([full // parts] * parts)
                fused.append({"patterns": [pattern], "shape": shape, "partition_dim": dim})
    info: dict[str, object] = {
        constants.UNIVERSAL_CHECKPOINT_VERSION_KEY: constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        constants.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(rows),
        constants.TP_REPLICATED_PARAMETER_PATTERNS: sorted(whole),
        constants.VOCABULARY_PARAMETER_PATTERNS: sorted(vocab), constants.PARAMETER_WITH_SUB_PARAMS: fused}
    if vocab_size is not None:
        info[constants.ORIGINAL_VOCAB_SIZE] = vocab_size
    return info
