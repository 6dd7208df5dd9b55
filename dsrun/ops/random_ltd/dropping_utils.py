"""Token sampling, gather and scatter for random-LTD, in plain torch (CPU and CUDA alike).

DeepSpeed's ``deepspeed.ops.random_ltd.dropping_utils`` needs a compiled CUDA op; these are the same
functions on ``torch.gather``/``torch.scatter``, so random-LTD runs wherever torch does. Indices are int64
(``torch.gather``'s type; DeepSpeed's op returns int32).

Shapes: hidden states are ``[batch, seq, hidden]`` (``batch_first=True``) or ``[seq, batch, hidden]``;
``sorted_indices`` is ``[batch, reserved]``, each row a sorted set of distinct kept positions. Sorting keeps
the kept tokens in their original order, so a causal layer run on them sees a causal sub-sequence.
"""
from __future__ import annotations

import torch


def _sample_sorted(reserved_length: int, seq_length: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """``rows`` independent uniform draws of ``reserved_length`` distinct positions of ``seq_length``, sorted."""
    weights = torch.ones((rows, seq_length), device=device)
    return torch.multinomial(weights, reserved_length).sort(dim=1).values


def gpt_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                      device: torch.device | str = "cpu",
                      attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kept positions ``[layers, batch, reserved]`` for a decoder, and the attention mask cut to the kept
    length (``attn_mask[:, :, :reserved, :reserved]``: a causal mask over sorted positions is again causal)."""
    indices = _sample_sorted(reserved_length, seq_length, layers * batch_size, device)
    indices = indices.reshape(layers, batch_size, reserved_length)
    new_mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return indices, new_mask


def bert_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                       device: torch.device | str = "cpu",
                       attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Kept positions ``[layers, batch, reserved]`` for an encoder, and per layer the attention mask
    ``[batch, 1, reserved, reserved]`` restricted to the kept rows and columns (a padding mask is arbitrary,
    so it must be gathered)."""
    if attn_mask is None:
        raise ValueError("bert_sample_tokens needs the attention mask (an encoder's mask is not causal)")
    indices = _sample_sorted(reserved_length, seq_length, layers * batch_size, device)
    indices = indices.reshape(layers, batch_size, reserved_length)
    masks = []
    for layer_indices in indices:
        rows = layer_indices[:, None, :, None].expand(-1, attn_mask.size(1), -1, attn_mask.size(3))
        kept_rows = attn_mask.expand(batch_size, -1, -1, -1).gather(2, rows)
        cols = layer_indices[:, None, None, :].expand(-1, attn_mask.size(1), reserved_length, -1)
        masks.append(kept_rows.gather(3, cols))
    return indices, masks


def _index_for(hidden: torch.Tensor, sorted_indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """``sorted_indices`` ``[batch, reserved]`` expanded to index ``hidden`` along its sequence dimension."""
    index = sorted_indices.to(device=hidden.device, dtype=torch.int64)
    if not batch_first:
        index = index.t()
    return index.unsqueeze(-1).expand(*index.shape, hidden.size(-1))


def gather_tokens(hidden: torch.Tensor, sorted_indices: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """The kept tokens of ``hidden``: ``[batch, reserved, hidden]`` (or seq-first)."""
    return hidden.gather(1 if batch_first else 0, _index_for(hidden, sorted_indices, batch_first))


def scatter_tokens(hidden: torch.Tensor, tokens: torch.Tensor, sorted_indices: torch.Tensor,
                   batch_first: bool = True) -> torch.Tensor:
    """A copy of ``hidden`` with the kept positions replaced by ``tokens``."""
    return hidden.scatter(1 if batch_first else 0, _index_for(hidden, sorted_indices, batch_first), tokens)


class GatherTokens(torch.autograd.Function):
    """``(activations, kept) = GatherTokens.apply(activations, sorted_indices, batch_first)``: the input passed
    through and its kept tokens. The gradient of ``activations`` is the pass-through gradient plus the kept
    tokens' gradients added at their positions."""

    @staticmethod
    def forward(ctx, activations: torch.Tensor, sorted_indices: torch.Tensor,
                batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        ctx.shape = activations.shape
        return activations.view_as(activations), gather_tokens(activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx, a_gradients: torch.Tensor | None, g_gradients: torch.Tensor | None):
        (sorted_indices,) = ctx.saved_tensors
        grad = a_gradients.clone() if a_gradients is not None else None
        if g_gradients is not None:
            if grad is None:
                grad = g_gradients.new_zeros(ctx.shape)
            index = _index_for(grad, sorted_indices, ctx.batch_first)
            grad.scatter_add_(1 if ctx.batch_first else 0, index, g_gradients.contiguous())
        return grad, None, None


class ScatterTokens(torch.autograd.Function):
    """``ScatterTokens.apply(all_activations, layer_activations, sorted_indices, batch_first)``: a copy of
    ``all_activations`` with the kept positions overwritten by ``layer_activations``. Gradients: the output's
    gradient with the kept positions zeroed (they no longer depend on ``all_activations``), and the kept
    positions' gradient for ``layer_activations``."""

    @staticmethod
    def forward(ctx, all_activations: torch.Tensor, layer_activations: torch.Tensor, sorted_indices: torch.Tensor,
                batch_first: bool) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        return scatter_tokens(all_activations, layer_activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx, out_gradients: torch.Tensor):
        (sorted_indices,) = ctx.saved_tensors
        out_gradients = out_gradients.contiguous()
        dim = 1 if ctx.batch_first else 0
        index = _index_for(out_gradients, sorted_indices, ctx.batch_first)
        layer_grad = out_gradients.gather(dim, index)
        all_grad = out_gradients.scatter(dim, index, torch.zeros_like(layer_grad))
        return all_grad, layer_grad, None, None
