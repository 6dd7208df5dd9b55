"""The vocabulary over the tensor-parallel ranks (``tensor_parallel.vocab_parallel_lm_head``): the input embedding
and the LM head cut by vocabulary rows, and the cross-entropy computed from each rank's slice of the logits, so no
rank ever holds the whole vocabulary's logits (Megatron's vocabulary-parallel embedding and cross-entropy).

* :class:`VocabParallelEmbedding`: this rank's rows of the embedding table; a token outside them looks up zeros,
  and the ranks' lookups are summed over the group (forward all-reduce, backward identity: every rank receives the
  output's whole gradient, and only its own rows' lookups were kept).
* The LM head: column-parallel over the vocabulary (:class:`~dsrun.tensor_parallel.layers.ColumnParallelLinear`),
  its output not gathered: the model returns this rank's logits (``[..., its vocabulary slice]``).
* :func:`vocab_parallel_cross_entropy`: per token, the maximum and the sum of exponentials all-reduced over the
  group, the target's logit taken on the rank that holds it and summed; backward, this rank's slice of
  ``softmax - onehot`` (no communication). A Hugging Face causal LM's ``loss_function`` becomes
  :func:`causal_lm_loss` (its shift, ``ignore_index`` and mean; ``num_items_in_batch`` sums instead).

A tied LM head and embedding (the same ``Parameter``) are cut once and stay tied: both read the same rows (the
coupled vocabulary-parallel embedding DeepSpeed leaves whole). The cut is DeepSpeed's uneven one (97 rows over 2
ranks: 49 and 48; in grains of ``tensor_parallel.tp.tp_grain_size``), recorded in the layout like every split.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsrun import comm
from dsrun.checkpoint.tensor_parallel import rank_widths
from dsrun.inference.groups import TPGroup
from dsrun.utils.errors import ConfigError, Problem

from .layers import ColumnParallelLinear, reduce_from_group
from .split import TPLayout, cut_parameter, cut_widths

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + rows)`` of an embedding table; the lookups summed over the group."""

    def __init__(self, weight: nn.Parameter, start: int, padding_idx: int | None, group: ProcessGroup | None,
                 tp_size: int):
        super().__init__()
        self.weight, self.start, self.padding_idx, self.group, self.tp_size = weight, start, padding_idx, group, tp_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        rows = self.weight.shape[0]
        outside = (local < 0) | (local >= rows)
        pad = self.padding_idx - self.start if self.padding_idx is not None else None  # its row gets no gradient
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad if pad in range(rows) else None)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.group) if self.tp_size > 1 else out

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.weight.shape[0]} of the vocabulary, over {self.tp_size} ranks"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits cut by vocabulary (``[N, V_r]``, this rank's columns from ``start``)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: torch.Tensor, target: torch.Tensor, start: int, group: ProcessGroup | None
                ) -> torch.Tensor:
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, op=comm.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~mine, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        both = torch.stack([picked, total])  # one all-reduce for the two sums
        comm.all_reduce(both, group=group)
        picked, total = both[0], both[1]
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, mine)
        return total.log() - picked

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, mine = ctx.saved_tensors
        softmax.scatter_add_(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return softmax * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 group: ProcessGroup | None) -> torch.Tensor:
    """Each token's cross-entropy (``[N]``) from this rank's slice of its logits (``[N, V_r]``, vocabulary entries
    ``start`` onward); ``target`` holds whole-vocabulary ids. Collective over ``group``."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, group)


class causal_lm_loss:  # noqa: N801 - a callable standing in for a Hugging Face loss function
    """A Hugging Face causal LM's loss (``ForCausalLMLoss``: labels shifted left, ``ignore_index`` skipped, the
    mean; a sum over ``num_items_in_batch`` when given) from vocabulary-parallel logits."""

    def __init__(self, start: int, group: ProcessGroup | None):
        self.start, self.group = start, group

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        kept = target != ignore_index
        losses = vocab_parallel_cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                              target.masked_fill(~kept, 0), self.start, self.group)
        summed = (losses * kept).sum()
        if num_items_in_batch is not None:
            return summed / num_items_in_batch
        return summed / kept.sum()


def split_vocabulary(model: nn.Module, group: ProcessGroup | None, tp: TPGroup, grain: int, layout: TPLayout
                     ) -> None:
    """Cut ``model``'s input embedding and LM head (a Hugging Face causal LM's ``get_input_embeddings`` /
    ``get_output_embeddings``) by vocabulary rows for rank ``tp.rank`` and make its loss the vocabulary-parallel
    one; records the cut in ``layout``. ConfigError (``tensor_parallel.vocab_parallel_lm_head``) when the model
    has no such embeddings or loss."""
    key = "tensor_parallel.vocab_parallel_lm_head"
    getters = [getattr(model, name, None) for name in ("get_input_embeddings", "get_output_embeddings")]
    embedding, head = (get() if callable(get) else None for get in getters)
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear) or \
            not hasattr(type(model), "loss_function"):
        raise ConfigError(Problem(key, f"{type(model).__name__} has no input embedding, linear LM head and loss "
                                  "function to cut by vocabulary (a Hugging Face causal LM has them)",
                                  "leave vocab_parallel_lm_head out"))
    vocab = head.weight.shape[0]
    if embedding.weight.shape[0] != vocab or head.bias is not None:
        raise ConfigError(Problem(key, f"the embedding's {embedding.weight.shape[0]} rows and the LM head's {vocab} "
                                  "outputs (and no bias) must be one vocabulary", "leave vocab_parallel_lm_head out"))
    parts = cut_widths([vocab], tp.size, None, grain, key)
    start = sum(rank_widths(vocab, parts, tp.size)[0][:tp.rank])
    names = {id(module): name for name, module in model.named_modules()}
    tied = embedding.weight is head.weight
    for module in (embedding, head):
        layout.record(f"{names[id(module)]}.weight", module.weight, 0, parts)
    cut_parameter(head.weight, 0, parts, tp)
    if not tied:
        cut_parameter(embedding.weight, 0, parts, tp)
    model.set_input_embeddings(VocabParallelEmbedding(embedding.weight, start, embedding.padding_idx, group,
                                                      tp.size))
    model.set_output_embeddings(ColumnParallelLinear(head.weight, None, False, group, tp.size, tp.rank,
                                                     name=names[id(head)]))
    model.loss_function = causal_lm_loss(start, group)
