"""DeepSpeed-Ulysses sequence parallelism: attention over a sequence sharded across ranks.

Each rank of a sequence-parallel group of P ranks holds 1/P of the sequence with all attention heads. An
all-to-all re-shards q, k and v to the whole sequence with 1/P of the heads, the wrapped local attention runs
on that (attention is independent per head), and a second all-to-all returns the output to sequence shards
with all heads. Each all-to-all moves 1/P of a tensor's bytes per peer, so the traffic per rank stays
constant as the sequence and the group grow together (the Ulysses paper's argument).

``scatter_idx`` is the heads dimension and ``gather_idx`` the sequence dimension of the tensors the caller
passes, as in ``deepspeed.sequence.layer.DistributedAttention``: the defaults (2, 0) suit Megatron's
``[seq, batch, heads, head_dim]`` layout; ``[batch, seq, heads, head_dim]`` takes ``gather_idx=1``. The rank
order of the group is the order of the sequence shards. ``apply_rotary_pos_emb`` is DeepSpeed's rotary position
embedding of the same module (the torch path; DeepSpeed's optional fused kernel is not used).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.function import FunctionCtx

from dsrun import comm
from dsrun.sequence.recompute import ExchangedFromSource


def _all_to_all(x: torch.Tensor, group: comm.ProcessGroup, scatter_idx: int, gather_idx: int) -> torch.Tensor:
    """Split ``x`` into P pieces along ``scatter_idx``, send piece j to rank j of ``group``, and concatenate
    the pieces received along ``gather_idx`` in rank order."""
    world = comm.get_world_size(group)
    if world == 1:
        return x
    dims = x.dim()
    scatter_idx, gather_idx = scatter_idx % dims, gather_idx % dims
    if scatter_idx == gather_idx:
        raise ValueError(f"scatter_idx and gather_idx must differ, both are {scatter_idx}")
    if x.shape[scatter_idx] % world:
        raise ValueError(f"dimension {scatter_idx} of size {x.shape[scatter_idx]} does not split over "
                         f"{world} sequence-parallel ranks: make it a multiple of {world}")
    front = x.movedim(scatter_idx, 0)  # the pieces to send lie along dim 0
    pieces = front.reshape(world, front.shape[0] // world, *front.shape[1:]).contiguous()
    received = torch.empty_like(pieces)
    comm.all_to_all_single(received, pieces, group=group)
    gather = gather_idx + 1 if gather_idx < scatter_idx else gather_idx  # its place in ``front``
    # received: [P, piece, ...] with the gathered dimension at gather + 1; put P just before it and merge them
    moved = received.movedim(0, gather)
    shape = list(moved.shape)
    merged = moved.reshape(*shape[:gather], shape[gather] * shape[gather + 1], *shape[gather + 2:])
    return merged.movedim(0, scatter_idx)


class _SeqAllToAll(torch.autograd.Function):
    """The all-to-all as an autograd function: its gradient is the all-to-all that swaps the two dims."""

    @staticmethod
    def forward(ctx: FunctionCtx, group: comm.ProcessGroup, x: torch.Tensor, scatter_idx: int,
                gather_idx: int) -> torch.Tensor:
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        return _all_to_all(x, group, scatter_idx, gather_idx)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        return None, _all_to_all(grad.contiguous(), ctx.group, ctx.gather_idx, ctx.scatter_idx), None, None


def single_all_to_all(x: torch.Tensor, scatter_idx: int, gather_idx: int,
                      group: comm.ProcessGroup = None) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: ``x`` split along ``scatter_idx``, gathered along
    ``gather_idx`` (the sequence-parallel exchange)."""
    return _SeqAllToAll.apply(group, x, scatter_idx, gather_idx)


class DistributedAttention(torch.nn.Module):
    """Wrap ``local_attention(q, k, v, *args, **kwargs)`` so it runs on a sequence sharded over
    ``sequence_process_group`` (``None``: the whole world).

    ``forward(query, key, value, *args, **kwargs)`` takes this rank's sequence shard of each (all heads) and
    returns this rank's shard of the attention output, equal to running ``local_attention`` on the whole
    sequence and slicing. Extra arguments (whatever ``local_attention`` takes) go to it unchanged: a mask must
    already be the full-sequence one. ``sp_stream`` is accepted for DeepSpeed's signature; CUDA stream overlap
    of the exchanges is not implemented, they run on the current stream.
    """

    def __init__(self, local_attention: Callable[..., torch.Tensor], sequence_process_group: comm.ProcessGroup,
                 scatter_idx: int = 2, gather_idx: int = 0, sp_stream: torch.cuda.Stream | None = None) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object,
                **kwargs: object) -> torch.Tensor:
        return single_all_to_all(self._attend(query, key, value, *args, **kwargs), self.gather_idx,
                                 self.scatter_idx, self.spg)

    def forward_projected(self, projection: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor, *args: object, **kwargs: object) -> Any:
        """``projection(self(query, key, value, *args, **kwargs))`` (the output projection, say), keeping one
        tensor less per call for backward: what ``projection`` saves of this rank's (contiguous) output shard is
        kept as the attention output before the exchange back, which the local attention saves already, and
        backward runs that exchange again (:mod:`dsrun.sequence.recompute`). The values are the same."""
        context = self._attend(query, key, value, *args, **kwargs)
        output = single_all_to_all(context, self.gather_idx, self.scatter_idx, self.spg).contiguous()

        def redo(source: torch.Tensor) -> torch.Tensor:
            return _all_to_all(source, self.spg, self.gather_idx, self.scatter_idx).contiguous()

        with ExchangedFromSource(output, context, redo):
            return projection(output)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object,
                **kwargs: object) -> torch.Tensor:
        """The local attention over the whole sequence with this rank's heads (before the exchange back)."""
        q, k, v = (single_all_to_all(t, self.scatter_idx, self.gather_idx, self.spg) for t in (query, key, value))
        return self.local_attn(q, k, v, *args, **kwargs)


# --- rotary position embedding, as DeepSpeed's sequence layer applies it --------------------------------------
_torchembed_available = False  # DeepSpeed's fused RoPE kernel (torchembed) is never used here: the torch path


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's halves ``[a, b]`` as ``[-b, a]`` (the sine term's sign change)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``freqs_cos.shape[-1]`` features of ``t`` (``[seq, ..., dim]``) by the rotary angles
    whose cosines and sines are given (broadcast against ``t``); the remaining features pass unchanged."""
    rot_dim = freqs_cos.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * freqs_cos + _rotate_half(rotated) * freqs_sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)
