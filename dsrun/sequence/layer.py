"""DeepSpeed-Ulysses sequence parallelism: attention over a sequence sharded across ranks.

Each rank of a sequence-parallel group of P ranks holds 1/P of the sequence with all attention heads. An
all-to-all re-shards q, k and v to the whole sequence with 1/P of the heads, the wrapped local attention runs
on that (attention is independent per head), and a second all-to-all returns the output to sequence shards
with all heads. Each all-to-all moves 1/P of a tensor's bytes per peer, so the traffic per rank stays
constant as the sequence and the group grow together (the Ulysses paper's argument).

``scatter_idx`` is the heads dimension and ``gather_idx`` the sequence dimension of the tensors the caller
passes, as in ``deepspeed.sequence.layer.DistributedAttention``: the defaults (2, 0) suit Megatron's
``[seq, batch, heads, head_dim]`` layout; ``[batch, seq, heads, head_dim]`` takes ``gather_idx=1``. The rank
order of the group is the order of the sequence shards. Heads that P does not divide split unevenly (the first
``heads % P`` ranks take one more, as DeepSpeed's uneven-heads path). ``_SeqAllToAll`` and ``single_all_to_all``
keep DeepSpeed's signatures (``batch_dim_idx``: DeepSpeed's layout rule for 4-D tensors). ``apply_rotary_pos_emb`` is DeepSpeed's rotary position
embedding of the same module (the torch path; DeepSpeed's optional fused kernel is not used).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.function import FunctionCtx

from dsrun import comm
from dsrun.sequence.recompute import ExchangedFromSource


_uneven_num_heads: int | None = None  # the last uneven head count split (DeepSpeed's num_kv_heads for Ulysses)


def head_split(num_heads: int, world: int) -> list[int]:
    """Heads per rank when ``world`` does not divide ``num_heads``: the first ``num_heads % world`` ranks take one
    more (DeepSpeed's ``get_shard_size_list`` of the heads)."""
    return [num_heads // world + (1 if r < num_heads % world else 0) for r in range(world)]


def _all_to_all(x: torch.Tensor, group: comm.ProcessGroup, scatter_idx: int, gather_idx: int,
                num_heads: int | None = None) -> torch.Tensor:
    """Split ``x`` into P pieces along ``scatter_idx``, send piece j to rank j of ``group``, and concatenate
    the pieces received along ``gather_idx`` in rank order.

    Pieces are equal unless heads split unevenly: scattering a dimension that P does not divide (heads) sends
    rank j its :func:`head_split` share and records the count (an evenly split scatter of dimension 2 clears it);
    gathering heads split from ``num_heads`` (default: the recorded count, for heads at dimension 2) receives
    each rank's share. Every rank makes the same calls, so the record is the same on all of them."""
    global _uneven_num_heads
    world = comm.get_world_size(group)
    if world == 1:
        return x
    dims = x.dim()
    scatter_idx, gather_idx = scatter_idx % dims, gather_idx % dims
    if scatter_idx == gather_idx:
        raise ValueError(f"scatter_idx and gather_idx must differ, both are {scatter_idx}")
    me = comm.get_rank(group)
    size = x.shape[scatter_idx]
    scatter_sizes, gather_sizes = [size // world] * world, [x.shape[gather_idx]] * world
    total = num_heads if num_heads is not None else (_uneven_num_heads if gather_idx == 2 else None)
    if size % world:
        if size < world:
            raise ValueError(f"dimension {scatter_idx} of size {size} does not split over {world} "
                             f"sequence-parallel ranks: it needs at least {world} (one head per rank)")
        scatter_sizes = head_split(size, world)  # uneven heads
        _uneven_num_heads = size
    else:
        if scatter_idx == 2:
            _uneven_num_heads = None
        if total is not None and total % world:  # gathering heads that were split unevenly
            gather_sizes = head_split(total, world)
            if gather_sizes[me] != x.shape[gather_idx]:
                raise ValueError(f"gathering {total} heads split unevenly over {world} ranks: rank {me} holds "
                                 f"{x.shape[gather_idx]} along dimension {gather_idx}, expected {gather_sizes[me]}")
    front = x.movedim(scatter_idx, 0)
    rest = front.shape[1:]
    per_row = rest.numel()
    send = front.contiguous().view(-1)
    share = scatter_sizes[me]
    at = gather_idx + 1 if gather_idx < scatter_idx else gather_idx  # the gathered dim's place in ``front``
    shapes = []
    for g in gather_sizes:
        shape = [share, *rest]
        shape[at] = g
        shapes.append(shape)
    recv_sizes = [torch.Size(shape).numel() for shape in shapes]
    received = torch.empty(sum(recv_sizes), dtype=x.dtype, device=x.device)
    comm.all_to_all_single(received, send, output_split_sizes=recv_sizes,
                           input_split_sizes=[n * per_row for n in scatter_sizes], group=group)
    pieces = [piece.view(shape) for piece, shape in zip(received.split(recv_sizes), shapes)]
    return torch.cat(pieces, dim=at).movedim(0, scatter_idx)


def _layout(x: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int | None) -> tuple[int, int]:
    """The (scatter, gather) dimensions: as given, or with DeepSpeed's ``batch_dim_idx`` for a 4-D
    ``[batch, seq, heads, dim]`` / ``[seq, batch, heads, dim]`` tensor: heads are dimension 2 and the sequence is
    the other of 0 and 1; ``scatter_idx`` >= 2 scatters the heads and gathers the sequence, < 2 the reverse."""
    if batch_dim_idx is None or x.dim() != 4:
        return scatter_idx, gather_idx
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"batch_dim_idx must be 0 or 1, got {batch_dim_idx}")
    seq = 1 - batch_dim_idx
    return (2, seq) if scatter_idx >= 2 else (seq, 2)


class _SeqAllToAll(torch.autograd.Function):
    """The all-to-all as an autograd function (DeepSpeed's signature): its gradient is the all-to-all that swaps
    the two dims. ``stream``/``handle``/``type``/``is_fwd`` are DeepSpeed's overlap switches: the exchanges run
    on the current stream, in order."""

    @staticmethod
    def forward(ctx: FunctionCtx, group: comm.ProcessGroup, x: torch.Tensor, scatter_idx: int, gather_idx: int,
                batch_dim_idx: int | None = None, stream: object = None, handle: object = None, type: object = None,
                is_fwd: bool = True, num_heads: int | None = None) -> torch.Tensor:
        scatter_idx, gather_idx = _layout(x, scatter_idx, gather_idx, batch_dim_idx)
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        ctx.num_heads = x.shape[scatter_idx]  # what the backward gathers back (uneven heads)
        return _all_to_all(x, group, scatter_idx, gather_idx, num_heads=num_heads)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        back = _all_to_all(grad.contiguous(), ctx.group, ctx.gather_idx, ctx.scatter_idx, num_heads=ctx.num_heads)
        return (None, back) + (None,) * 8


def single_all_to_all(x: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int | None = None,
                      group: comm.ProcessGroup = None, async_op: bool = False, handle: object = None,
                      type: object = None, *, num_heads: int | None = None) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (DeepSpeed's signature): ``x`` split along ``scatter_idx``,
    gathered along ``gather_idx`` (``batch_dim_idx``: DeepSpeed's layout rule for 4-D tensors, :func:`_layout`;
    ``num_heads``: the head count a gather of heads split unevenly comes from, default the last uneven split's).
    ``async_op`` is refused: the exchange runs synchronously."""
    if async_op:
        raise ValueError("single_all_to_all(async_op=True): dsrun runs the sequence exchange synchronously; "
                         "pass async_op=False")
    return _SeqAllToAll.apply(group, x, scatter_idx, gather_idx, batch_dim_idx, None, None, None, True, num_heads)


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
                                 self.scatter_idx, None, self.spg, num_heads=query.shape[self.scatter_idx])

    def forward_projected(self, projection: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor, *args: object, **kwargs: object) -> Any:
        """``projection(self(query, key, value, *args, **kwargs))`` (the output projection, say), keeping one
        tensor less per call for backward: what ``projection`` saves of this rank's (contiguous) output shard is
        kept as the attention output before the exchange back, which the local attention saves already, and
        backward runs that exchange again (:mod:`dsrun.sequence.recompute`). The values are the same."""
        context = self._attend(query, key, value, *args, **kwargs)
        heads = query.shape[self.scatter_idx]
        output = single_all_to_all(context, self.gather_idx, self.scatter_idx, None, self.spg,
                                   num_heads=heads).contiguous()

        def redo(source: torch.Tensor) -> torch.Tensor:
            return _all_to_all(source, self.spg, self.gather_idx, self.scatter_idx, num_heads=heads).contiguous()

        with ExchangedFromSource(output, context, redo):
            return projection(output)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object,
                **kwargs: object) -> torch.Tensor:
        """The local attention over the whole sequence with this rank's heads (before the exchange back)."""
        q, k, v = (single_all_to_all(t, self.scatter_idx, self.gather_idx, None, self.spg) for t in (query, key, value))
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
