"""Block-sparse attention in plain torch: only the non-zero blocks of a layout are ever computed.

``softmax(Q Kᵀ · scale + masks) V`` restricted to the blocks ``(h, i, j)`` where ``layout[h, i, j] == 1``
(every other score is ``-inf``). The non-zero blocks are listed once per layout (:func:`block_index`,
sorted by head and block row); the computation walks that list in chunks. Per chunk it gathers the query,
key and value blocks, computes the chunk's ``block x block`` scores and folds them into a running row
maximum, row sum and output, the way flash attention streams over keys (here a row's blocks are any
columns, so the running state is updated with ``scatter_reduce``/``index_add``). Backward recomputes each
chunk's scores from ``Q``, ``K`` and the saved log-sum-exp.

Memory: autograd keeps only the output and one log-sum-exp per query (plus ``Q``, ``K``, ``V``, which
exist anyway); the working set of a chunk is bounded by the size of ``Q``. Nothing of size
``seq_len²`` is allocated, whatever the density; time grows with the number of non-zero blocks.
Everything is ordinary torch, so the same code runs on CPU and CUDA, in fp32, bf16 or fp16 (scores,
softmax statistics and accumulators in fp32).

Masks follow DeepSpeed's sparse softmax: ``scale`` first, then ``rpe`` (added), then
``key_padding_mask`` ``[batch, seq]`` and ``attn_mask`` ``[seq, seq]``, each added (mode ``"add"``) or
turned into ``-inf`` where zero (mode ``"mul"``). They are constants (no gradient flows into them). A query
row whose every score is ``-inf`` outputs zeros. ``causal`` drops the blocks above the diagonal and masks
the upper triangle inside diagonal blocks; ``dropout_p`` drops attention probabilities (the masks are
drawn from a generator seeded per call and drawn again in backward, so nothing of their size is kept).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx

NEG_INF = float("-inf")
MASK_MODES = ("add", "mul")


@dataclass(frozen=True)
class BlockIndex:
    """The non-zero blocks of a ``[heads, num_blocks, num_blocks]`` layout, sorted by (head, row).

    ``query[n] = head·num_blocks + row`` and ``key[n] = head·num_blocks + col`` index the blocks of
    ``Q``/``K``/``V`` reshaped to ``[batch, heads·num_blocks, block, head_dim]``. ``query_cpu`` is a host copy
    of ``query``, so chunk boundaries never wait for the device.
    """

    block: int
    heads: int
    num_blocks: int
    head: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    diagonal: torch.Tensor
    query_cpu: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.query_cpu.numel())


def block_index(layout: torch.Tensor, block: int, causal: bool = False,
                device: torch.device | str | None = None) -> BlockIndex:
    """List the non-zero blocks of ``layout`` (``causal`` first drops blocks above the diagonal)."""
    layout = layout.detach().to("cpu") != 0
    if causal:
        layout = layout.tril()
    heads, num_blocks, _ = layout.shape
    head, row, col = layout.nonzero(as_tuple=True)  # row-major: sorted by head, then row, then column
    query = head * num_blocks + row
    on = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    return BlockIndex(block=block, heads=heads, num_blocks=num_blocks, head=on(head), row=on(row), col=on(col),
                      query=on(query), key=on(head * num_blocks + col), diagonal=on(row == col), query_cpu=query)


@dataclass(frozen=True)
class _Masks:
    rpe: torch.Tensor | None
    key_padding: torch.Tensor | None
    key_padding_mul: bool
    attn: torch.Tensor | None
    attn_mul: bool
    causal: bool


def _chunks(index: BlockIndex, batch: int, head_dim: int, budget: int) -> list[tuple[int, int, int, int]]:
    """``(first block, end block, first row, last row)`` per chunk: each chunk's gathered blocks and scores
    hold about ``budget`` elements (the size of ``Q``), so the working set never grows with the sequence."""
    per_block = batch * index.block * (head_dim + index.block)
    size = max(1, budget // per_block)
    rows = index.query_cpu
    return [(start, min(start + size, index.nnz), int(rows[start]), int(rows[min(start + size, index.nnz) - 1]))
            for start in range(0, index.nnz, size)]


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and the 16-bit types; fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def _scores(qb: torch.Tensor, kb: torch.Tensor, index: BlockIndex, start: int, end: int, scale: float,
            masks: _Masks) -> torch.Tensor:
    """The chunk's scores ``[batch, blocks, block, block]`` in fp32 (fp64 for fp64), scaled and masked."""
    acc = _accumulation_dtype(qb.dtype)
    rows, cols = index.row[start:end], index.col[start:end]
    qg = qb.index_select(1, index.query[start:end])
    kg = kb.index_select(1, index.key[start:end])
    scores = torch.matmul(qg, kg.transpose(-1, -2)).to(acc) * scale
    blk, nb = index.block, index.num_blocks
    if masks.rpe is not None:  # [batch, heads, seq, seq] (broadcast) -> this chunk's blocks
        rpe = masks.rpe.reshape(masks.rpe.shape[0], masks.rpe.shape[1], nb, blk, nb, blk)
        scores = scores + rpe[:, index.head[start:end], rows, :, cols, :].transpose(0, 1).to(acc)
    if masks.key_padding is not None:  # [batch, seq] -> [batch, blocks, 1, block]
        kp = masks.key_padding.reshape(-1, nb, blk).index_select(1, cols).unsqueeze(2)
        scores = scores.masked_fill(kp == 0, NEG_INF) if masks.key_padding_mul else scores + kp.to(acc)
    if masks.attn is not None:  # [seq, seq] -> [blocks, block, block]
        am = masks.attn.reshape(nb, blk, nb, blk)[rows, :, cols, :]
        scores = scores.masked_fill(am == 0, NEG_INF) if masks.attn_mul else scores + am.to(acc)
    if masks.causal:
        upper = torch.ones(blk, blk, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(index.diagonal[start:end, None, None] & upper, NEG_INF)
    return scores


def _keep_mask(generator: torch.Generator | None, shape: torch.Size, dropout_p: float,
               device: torch.device) -> torch.Tensor | None:
    if generator is None:
        return None
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _as_blocks(t: torch.Tensor, index: BlockIndex) -> torch.Tensor:
    batch, heads, _, head_dim = t.shape
    return t.reshape(batch, heads * index.num_blocks, index.block, head_dim)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, scale: float, masks: _Masks,
             dropout_p: float, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, _, _, head_dim = q.shape
    qb, kb, vb = _as_blocks(q, index), _as_blocks(k, index), _as_blocks(v, index)
    segments, dtype = index.heads * index.num_blocks, _accumulation_dtype(q.dtype)
    row_max = q.new_full((batch, segments, index.block), NEG_INF, dtype=dtype)
    row_sum = q.new_zeros((batch, segments, index.block), dtype=dtype)
    acc = q.new_zeros((batch, segments, index.block, head_dim), dtype=dtype)
    generator = _generator(seed, q.device)
    for start, end, first, last in _chunks(index, batch, head_dim, q.numel()):
        scores = _scores(qb, kb, index, start, end, scale, masks)
        local = index.query[start:end] - first
        old_max = row_max[:, first:last + 1]
        block_max = scores.amax(-1)
        new_max = old_max.scatter_reduce(1, local.view(1, -1, 1).expand_as(block_max), block_max, "amax")
        safe_max = new_max.masked_fill(new_max == NEG_INF, 0.0)  # rows with nothing unmasked yet
        rescale = torch.exp(old_max - safe_max)
        probs = torch.exp(scores - safe_max.index_select(1, local).unsqueeze(-1))
        row_sum[:, first:last + 1] = row_sum[:, first:last + 1] * rescale + torch.zeros_like(old_max).index_add_(
            1, local, probs.sum(-1))
        keep = _keep_mask(generator, probs.shape, dropout_p, q.device)
        if keep is not None:
            probs = probs * keep / (1.0 - dropout_p)
        values = torch.matmul(probs.to(v.dtype), vb.index_select(1, index.key[start:end])).to(dtype)
        acc[:, first:last + 1] = acc[:, first:last + 1] * rescale.unsqueeze(-1) + torch.zeros(
            (batch, last + 1 - first, index.block, head_dim), dtype=dtype, device=q.device).index_add_(
            1, local, values)
        row_max[:, first:last + 1] = new_max
    attended = row_sum > 0
    out = torch.where(attended.unsqueeze(-1), acc / row_sum.clamp_min(1e-38).unsqueeze(-1), 0.0)
    lse = torch.where(attended, row_max + torch.log(row_sum.clamp_min(1e-38)), float("inf"))
    return out.reshape(q.shape).to(q.dtype), lse


def _backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, index: BlockIndex, scale: float, masks: _Masks, dropout_p: float,
              seed: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, _, _, head_dim = q.shape
    qb, kb, vb = _as_blocks(q, index), _as_blocks(k, index), _as_blocks(v, index)
    grad_b = _as_blocks(grad_out.contiguous(), index)
    dtype = _accumulation_dtype(q.dtype)
    delta = (grad_b.to(dtype) * _as_blocks(out, index).to(dtype)).sum(-1)  # rowsum(dO · O) = Σ_j p_ij dp_ij
    dq, dk, dv = (torch.zeros(qb.shape, dtype=dtype, device=q.device) for _ in range(3))
    generator = _generator(seed, q.device)
    for start, end, _, _ in _chunks(index, batch, head_dim, q.numel()):
        queries, keys = index.query[start:end], index.key[start:end]
        scores = _scores(qb, kb, index, start, end, scale, masks)
        probs = torch.exp(scores - lse.index_select(1, queries).unsqueeze(-1))
        grad_g = grad_b.index_select(1, queries)
        vg = vb.index_select(1, keys)
        keep = _keep_mask(generator, probs.shape, dropout_p, q.device)
        dropped = probs if keep is None else probs * keep / (1.0 - dropout_p)
        dv.index_add_(1, keys, torch.matmul(dropped.transpose(-1, -2).to(v.dtype), grad_g).to(dtype))
        grad_probs = torch.matmul(grad_g, vg.transpose(-1, -2)).to(dtype)
        if keep is not None:
            grad_probs = grad_probs * keep / (1.0 - dropout_p)
        grad_scores = (probs * (grad_probs - delta.index_select(1, queries).unsqueeze(-1)) * scale).to(q.dtype)
        dq.index_add_(1, queries, torch.matmul(grad_scores, kb.index_select(1, keys)).to(dtype))
        dk.index_add_(1, keys, torch.matmul(grad_scores.transpose(-1, -2), qb.index_select(1, queries)).to(dtype))
    return tuple(g.reshape(q.shape).to(q.dtype) for g in (dq, dk, dv))  # type: ignore[return-value]


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, scale: float,
                dropout_p: float, seed: int | None, rpe: torch.Tensor | None, key_padding: torch.Tensor | None,
                key_padding_mul: bool, attn: torch.Tensor | None, attn_mul: bool, causal: bool) -> torch.Tensor:
        masks = _Masks(rpe, key_padding, key_padding_mul, attn, attn_mul, causal)
        out, lse = _forward(q, k, v, index, scale, masks, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, rpe, key_padding, attn)
        ctx.settings = (index, scale, dropout_p, seed, key_padding_mul, attn_mul, causal)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, rpe, key_padding, attn = ctx.saved_tensors
        index, scale, dropout_p, seed, key_padding_mul, attn_mul, causal = ctx.settings
        masks = _Masks(rpe, key_padding, key_padding_mul, attn, attn_mul, causal)
        dq, dk, dv = _backward(grad_out, q, k, v, out, lse, index, scale, masks, dropout_p, seed)
        return (dq, dk, dv) + (None,) * 10


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex,
                           scale: float | None = None, *, rpe: torch.Tensor | None = None,
                           key_padding_mask: torch.Tensor | None = None, key_padding_mask_mode: str = "add",
                           attn_mask: torch.Tensor | None = None, attn_mask_mode: str = "mul",
                           causal: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of ``q``, ``k``, ``v`` ``[batch, heads, seq, head_dim]`` over the blocks of ``index``.

    ``scale`` defaults to ``head_dim ** -0.5``; ``seq`` must be ``index.num_blocks · index.block``. See the
    module docstring for the masks, ``causal`` and ``dropout_p``.
    """
    if q.shape != k.shape or k.shape != v.shape or q.dim() != 4:
        raise ValueError(f"q, k and v must have one shape [batch, heads, seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, seq, head_dim = q.shape
    if heads != index.heads or seq != index.num_blocks * index.block:
        raise ValueError(f"the layout covers {index.heads} heads x {index.num_blocks * index.block} tokens; "
                         f"the inputs have {heads} heads x {seq} tokens")
    for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
        if mode not in MASK_MODES:
            raise ValueError(f"{name}: got {mode!r}; allowed: 'add', 'mul'")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, seq):
        raise ValueError(f"key_padding_mask must be [batch, seq] = [{batch}, {seq}], got "
                         f"{tuple(key_padding_mask.shape)}")
    if attn_mask is not None and tuple(attn_mask.shape) != (seq, seq):
        raise ValueError(f"attn_mask must be [seq, seq] = [{seq}, {seq}], got {tuple(attn_mask.shape)}")
    if rpe is not None:
        rpe = rpe.expand(batch, heads, seq, seq)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _BlockSparseAttention.apply(q, k, v, index, head_dim ** -0.5 if scale is None else scale, dropout_p,
                                       seed, rpe, key_padding_mask, key_padding_mask_mode == "mul", attn_mask,
                                       attn_mask_mode == "mul", causal)
