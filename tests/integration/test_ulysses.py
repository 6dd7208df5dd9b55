"""DeepSpeed-Ulysses ``DistributedAttention`` on gloo ranks: each rank's output shard and its q/k/v gradients
equal single-process attention over the whole sequence (sliced), in both layouts, and each exchange moves
exactly (P - 1)/P of the tensor per rank."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers import run_ranks

SEQ, BATCH, HEADS, DIM = 24, 2, 4, 8


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Plain causal softmax attention on tensors laid out with the sequence at ``seq_dim`` (0 or 1), heads
    at 2, head_dim at 3."""
    order = (1, 2, 0, 3) if seq_dim == 0 else (0, 2, 1, 3)  # -> [batch, heads, seq, dim]
    qh, kh, vh = (t.permute(*order) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = scores.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ vh
    inverse = (2, 0, 1, 3) if seq_dim == 0 else (0, 2, 1, 3)
    return out.permute(*inverse)


def full_inputs(dtype: torch.dtype, seq_dim: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    shape = (SEQ, BATCH, HEADS, DIM) if seq_dim == 0 else (BATCH, SEQ, HEADS, DIM)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4)]  # q k v, dout


def sequence_parallel_attention(rank: int, world: int, dtype_name: str, seq_dim: int) -> dict:
    from dsrun import comm
    from dsrun.sequence.layer import DistributedAttention

    comm.init_distributed(dist_backend="gloo")
    try:
        dtype = getattr(torch, dtype_name)
        q, k, v, dout = full_inputs(dtype, seq_dim)
        shard = SEQ // world
        piece = [t.narrow(seq_dim, rank * shard, shard).clone().requires_grad_() for t in (q, k, v)]
        attn = DistributedAttention(lambda a, b, c: causal_attention(a, b, c, seq_dim), None,
                                    scatter_idx=2, gather_idx=seq_dim)
        comm.reset_comms_stats()
        out = attn(*piece)
        (out * dout.narrow(seq_dim, rank * shard, shard)).sum().backward()
        stats = comm.get_comms_stats().get("all_to_all_single", {})
        return {"out": out.detach().double().numpy(), "grads": [p.grad.double().numpy() for p in piece],
                "calls": stats.get("count", 0), "traffic": stats.get("traffic_bytes", 0),
                "shard_bytes": piece[0].numel() * piece[0].element_size()}
    finally:
        comm.destroy_process_group()


@pytest.mark.parametrize("dtype_name,seq_dim", [("float64", 0), ("float32", 1)])
def test_output_and_gradients_equal_single_process_attention(dtype_name, seq_dim):
    world = 2
    dtype = getattr(torch, dtype_name)
    q, k, v, dout = full_inputs(dtype, seq_dim)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = causal_attention(*ref_in, seq_dim)
    (ref * dout).sum().backward()
    ranks = run_ranks(sequence_parallel_attention, world, dtype_name, seq_dim, timeout=120)
    # the same arithmetic on the same numbers, per head; the only freedom is the summation order inside the
    # matmuls (length DIM for the scores, SEQ for the output and the gradients): bound by that many roundings
    eps = torch.finfo(dtype).eps
    bound = 4 * (DIM + SEQ) * eps
    shard = SEQ // world
    for rank, got in enumerate(ranks):
        want = ref.detach().narrow(seq_dim, rank * shard, shard).double().numpy()
        assert np.abs(got["out"] - want).max() <= bound * max(1.0, np.abs(want).max())
        for g, r in zip(got["grads"], ref_in):
            want_g = r.grad.narrow(seq_dim, rank * shard, shard).double().numpy()
            assert np.abs(g - want_g).max() <= bound * max(1.0, np.abs(want_g).max())
        # forward: q, k, v there and the output back; backward: the same four the other way
        assert got["calls"] == 8
        assert got["traffic"] == 8 * got["shard_bytes"] * (world - 1) // world


def heads_not_divisible(rank: int, world: int) -> str:
    from dsrun import comm
    from dsrun.sequence.layer import DistributedAttention

    comm.init_distributed(dist_backend="gloo")
    try:
        x = torch.zeros(4, 1, 3, 2)  # 3 heads over 2 ranks
        try:
            DistributedAttention(lambda a, b, c: a, None)(x, x, x)
        except ValueError as err:
            return str(err)
        return "no error"
    finally:
        comm.destroy_process_group()


def test_heads_that_do_not_split_over_the_group_are_refused():
    for message in run_ranks(heads_not_divisible, 2, timeout=60):
        assert "size 3 does not split over 2 sequence-parallel ranks" in message
