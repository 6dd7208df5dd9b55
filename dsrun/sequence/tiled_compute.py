"""Tiled compute over the sequence (DeepSpeed's ALST, ``deepspeed.runtime.sequence_parallel.ulysses_sp``):
``TiledMLP``, ``sequence_tiled_compute`` / ``SequenceTiledCompute`` and ``TiledFusedLogitsLoss``.

At long sequence lengths a block's intermediate activations (an MLP's 4x-wide hidden state, the logits over the
vocabulary) dominate memory. These autograd functions run the block on one slice of the sequence at a time: the
forward keeps only the input and the concatenated output, and the backward recomputes each slice's forward and
backpropagates through it alone, so at most one slice's intermediates exist at once (the price: the forward runs
twice). ``TiledFusedLogitsLoss`` does its backward inside the forward (the loss is last), so the logits are never
whole and the forward runs once. Each function calls ``fn`` on a slice like the block's own ``forward``; the
parameters' gradients accumulate over the slices into ``param.grad``; ``compute_params`` lists those parameters, as
in DeepSpeed: each is marked ``ds_grad_is_ready = False`` until the last slice, which tells ZeRO's gradient hooks
(stages 1-2's buckets, stage 3's) to wait for the whole gradient instead of reducing the first slice's. ``UlyssesSPAttentionHF`` and ``UlyssesSPDataLoaderAdapter``, the rest of DeepSpeed's ``ulysses_sp``, are
:mod:`dsrun.sequence.ulysses_hf`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

Tensor = torch.Tensor


def _backward_by_slices(run: Callable[[Tensor], Tensor], x: Tensor, upstream: Callable[[int, int, int], Tensor],
                        dim: int, shards: int, compute_params: list | None) -> Tensor | None:
    """Recompute ``run`` on each of ``shards`` slices of ``x`` along ``dim`` and backpropagate
    ``upstream(i, offset, length)`` (slice i's output gradient) through it; returns ``x``'s gradient (None where
    ``x`` needs none). The parameters' gradients accumulate as the slices go; ``compute_params`` are marked
    ``ds_grad_is_ready`` only for the last slice, so that ZeRO reduces each once, whole."""
    needs_grad = x.requires_grad
    x = x.detach()
    x_grad = torch.zeros_like(x) if needs_grad else None
    pieces = torch.chunk(x, shards, dim=dim)
    offset = 0
    for i, piece in enumerate(pieces):
        for param in compute_params or ():
            param.ds_grad_is_ready = i == len(pieces) - 1
        length = piece.shape[dim]
        piece = piece.detach().requires_grad_(needs_grad)
        with torch.enable_grad():
            out = run(piece)
        torch.autograd.backward(out, upstream(i, offset, length))
        if needs_grad:
            x_grad.narrow(dim, offset, length).copy_(piece.grad)
        offset += length
    return x_grad


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, module, x, shards, compute_params)``: ``fn(module, x)`` on ``shards`` slices of ``x``'s
    sequence dimension (the one before the last: ``[bs, seq, hidden]`` or ``[tokens, hidden]``)."""

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params):
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.compute_params = [p for p in compute_params or () if p.requires_grad]
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, piece) for piece in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad_out):
        (x, ) = ctx.saved_tensors
        hidden = x.shape[-1]
        flat = x.reshape(-1, hidden)  # batch and sequence as one dimension: slices are contiguous
        flat.requires_grad_(x.requires_grad)
        grad_out = grad_out.reshape(-1, hidden)
        x_grad = _backward_by_slices(lambda piece: ctx.fn(ctx.module, piece), flat,
                                     lambda i, offset, length: grad_out.narrow(0, offset, length), 0, ctx.shards,
                                     ctx.compute_params)
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None


def sequence_tiled_compute(fn: Callable[..., Tensor], seqlen: int, shards: int, kwargs_to_shard: dict,
                           kwargs_to_pass: dict, grad_requiring_tensor_key: str, compute_params: list | None = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> Tensor:
    """``fn(**sliced, **kwargs_to_pass)`` on ``shards`` slices of dimension 1 (the sequence, ``seqlen`` long) of
    every tensor in ``kwargs_to_shard``; the outputs joined along ``output_unshard_dimension`` (0: stacked, for a
    scalar per slice), then reduced (``None``, ``"mean"`` or ``"sum"``). Gradients flow to
    ``kwargs_to_shard[grad_requiring_tensor_key]`` and to the parameters ``fn`` uses."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function of :func:`sequence_tiled_compute` (its arguments, then the tensors, flattened)."""

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
                output_unshard_dimension, output_reduction, *args):
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"unknown value {output_reduction}: valid values are: none/mean/sum")
        if output_unshard_dimension not in (0, 1):
            raise ValueError(f"output_unshard_dimension {output_unshard_dimension}: the outputs are stacked (0) or "
                             "joined along the sequence (1)")
        to_shard = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        ctx.fn, ctx.shards, ctx.key = fn, shards, grad_requiring_tensor_key
        ctx.compute_params = [p for p in compute_params or () if p.requires_grad]
        ctx.to_shard, ctx.to_pass = to_shard, to_pass
        ctx.dim, ctx.reduction, ctx.n_args = output_unshard_dimension, output_reduction, len(args)
        ctx.key_index = (list(keys_to_shard) + list(keys_to_pass)).index(grad_requiring_tensor_key)
        step = math.ceil(seqlen / shards)
        with torch.no_grad():
            outputs = [fn(**{k: v[:, i * step:(i + 1) * step] for k, v in to_shard.items()}, **to_pass)
                       for i in range(shards)]
            joined = torch.stack(outputs) if output_unshard_dimension == 0 else torch.cat(outputs, dim=1)
        ctx.joined_shape = joined.shape
        return joined if output_reduction is None else getattr(joined, output_reduction)()

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.reduction is not None:  # each element's share of the reduced value
            scale = 1.0 / math.prod(ctx.joined_shape) if ctx.reduction == "mean" else 1.0
            grad_out = (grad_out * scale).expand(ctx.joined_shape)
        others = {k: torch.chunk(v, ctx.shards, dim=1) for k, v in ctx.to_shard.items() if k != ctx.key}

        def run(piece: Tensor, slices=iter(range(ctx.shards))) -> Tensor:
            i = next(slices)
            return ctx.fn(**{ctx.key: piece}, **{k: v[i] for k, v in others.items()}, **ctx.to_pass)

        def upstream(i: int, offset: int, length: int) -> Tensor:
            return grad_out[i] if ctx.dim == 0 else grad_out.narrow(1, offset, length)

        x_grad = _backward_by_slices(run, ctx.to_shard[ctx.key], upstream, 1, ctx.shards, ctx.compute_params)
        grads = [None] * ctx.n_args
        grads[ctx.key_index] = x_grad
        return (None, ) * 9 + tuple(grads)


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``: the loss
    ``fn(module, x, y[, mask])`` on ``shards`` slices of the flattened batch and sequence, its backward done slice by
    slice inside the forward, so the logits exist for one slice at a time; ``"mean"`` or ``"sum"`` over the slices'
    losses. The gradient stored for ``x`` is scaled by the upstream gradient in the backward; the parameters'
    gradients, made in the forward, are for an upstream gradient of 1 (a loss used as is, as DeepSpeed's)."""

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, compute_params, output_reduction):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction}: valid values are: "mean"/"sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must be at least 2D [batch_size, seq_len, ...]")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError("x and y batch/seq dims must match")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask must be 2D [batch_size, seq_len] like x and y, got {tuple(mask.shape)}")
        flat_x = x.reshape(-1, *x.shape[2:])
        flat_x.requires_grad_(x.requires_grad)
        ys = torch.chunk(y.reshape(-1, *y.shape[2:]), shards)
        masks = torch.chunk(mask.reshape(-1), shards) if mask is not None else None
        losses = []
        counter = iter(range(shards))

        def run(piece: Tensor) -> Tensor:
            i = next(counter)
            losses.append(fn(module, piece, ys[i], *((masks[i], ) if masks is not None else ())))
            return losses[-1]

        scale = torch.tensor(1.0 / shards if output_reduction == "mean" else 1.0, dtype=x.dtype, device=x.device)
        trains = x.requires_grad or any(p.requires_grad for p in getattr(module, "parameters", lambda: [])())
        if trains:  # the backward now, slice by slice: each slice's loss counts ``scale`` in the total
            x_grad = _backward_by_slices(run, flat_x, lambda i, offset, length: scale, 0, shards,
                                         [p for p in compute_params or () if p.requires_grad])
        else:
            x_grad = None
            with torch.no_grad():
                for piece in torch.chunk(flat_x, shards):
                    run(piece)
        ctx.x_grad = None if x_grad is None else x_grad.view_as(x)
        total = torch.stack([loss.detach() for loss in losses])
        return total.mean() if output_reduction == "mean" else total.sum()

    @staticmethod
    def backward(ctx, grad_out):
        x_grad = ctx.x_grad
        return (None, None, None if x_grad is None else x_grad * grad_out, None, None, None, None, None)


__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]
