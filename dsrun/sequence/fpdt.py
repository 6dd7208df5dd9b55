"""FPDT: Ulysses attention in sequence chunks with host-offloaded chunks (DeepSpeed's ``deepspeed.sequence.fpdt_layer``,
"fully pipelined distributed transformer").

**Layout.** A sample's sequence of L tokens is cut into ``P * n`` chunks and dealt round-robin over the P ranks of
the sequence group (:class:`FPDT_InputConstruct`): rank r holds global chunks ``r, r + P, r + 2P, ...``, so its i-th
local chunk is global chunk ``i * P + r``. After the Ulysses exchange of local chunk i (scatter heads, gather the
sequence) every rank holds global block i, chunks ``iP .. iP + P - 1``: one contiguous span of ``P * c`` tokens
with its share of the heads. Causal attention of block i needs blocks ``0..i`` only, the last one masked.

**Forward** (:class:`_FPDTGPUOffloadingAttentionImpl_`): per local chunk i of the hidden states ``[l, b, hidden]``,
project q/k/v (``qkv_linear_weight``, ``bias``), exchange them, apply the optional rotary embedding of block i,
attend over blocks ``0..i`` one at a time (softmax merged online over blocks through their log-sum-exp,
:func:`update_out_and_lse`), and exchange the block's output back: the result is ``[b, l, heads, head_dim]``.
The q/k/v, output and log-sum-exp chunks and the input chunks are kept for backward; with ``cpu_offloading`` on
an accelerator they wait in host memory (:class:`SequenceChunk`), a chunk on the device only while used.

**Backward** runs FlashAttention's recurrence per pair of blocks (``j <= i``): the probabilities are rebuilt from
the saved log-sum-exp, ``dV_j += P^T dO_i``, ``dS = P * (dO_i V_j^T - rowsum(dO_i * O_i))``, ``dQ_i += dS K_j``,
``dK_j += dS^T Q_i`` (scaled), over key blocks j outermost, so block j's q/k/v gradients are final after its turn:
they are exchanged back and turned into the input's and the projection's gradients at once.

dsrun computes each block's attention with torch (in fp32; fp64 for fp64 inputs) instead of DeepSpeed's flash-attn kernels, and its
copies to and from host memory are synchronous (no side streams); values are those of attention over the whole
sequence (``tests/integration/test_ulysses.py`` compares with one process). ``dropout`` must be 0 and
``attention_mask`` None (causal), as in DeepSpeed's implementation.
"""
from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from dsrun import comm

from dsrun.accelerator import get_accelerator
from dsrun.sequence.layer import apply_rotary_pos_emb, single_all_to_all


def _rotate_half_backward(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((second, -first), dim=-1)


def apply_rotary_pos_emb_backward(grad_output: torch.Tensor, freqs_cos: torch.Tensor,
                                  freqs_sin: torch.Tensor) -> torch.Tensor:
    """The gradient through :func:`dsrun.sequence.layer.apply_rotary_pos_emb` (its transpose)."""
    rot_dim = freqs_cos.shape[-1]
    rotated, passed = grad_output[..., :rot_dim], grad_output[..., rot_dim:]
    rotated = rotated * freqs_cos + _rotate_half_backward(rotated * freqs_sin)
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)


def update_out_and_lse(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                       block_lse: torch.Tensor, slice_: slice | tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one key block's attention into the running result: ``out`` ``[b, s, h, d]`` (fp32) and ``lse``
    ``[b, s, h, 1]`` so far, ``block_out`` ``[b, s, h, d]`` and ``block_lse`` ``[b, h, s]`` (flash-attn's layout),
    in fp32 (fp64 for fp64 blocks).
    ``slice_`` merges into that part of ``out``/``lse`` only."""
    acc = torch.promote_types(block_out.dtype, torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(-1).to(acc)
    block_out = block_out.to(acc)
    if out is None:
        if slice_ is not None:
            raise RuntimeError("the first update_out_and_lse takes no slice_")
        return block_out, block_lse.contiguous()
    old_out, old_lse = (out[slice_], lse[slice_]) if slice_ is not None else (out, lse)
    new_lse = torch.logaddexp(old_lse, block_lse)
    merged = torch.exp(old_lse - new_lse) * old_out + torch.exp(block_lse - new_lse) * block_out
    if slice_ is None:
        return merged, new_lse
    out[slice_], lse[slice_] = merged, new_lse
    return out, lse


class FPDT_InputConstruct(torch.nn.Module):
    """This rank's load-balanced share of a batch for FPDT: ``generate()`` gives tokens, labels and position ids
    (``[b, L]`` -> ``[b, L / P]``) of global chunks ``rank, rank + P, ...`` (chunks of ``fpdt_chunk_size / P``
    tokens, ``args.ds_sequence_parallel_fpdt_chunk_size``), the loss mask in the whole permuted order and the
    attention mask as given (DeepSpeed's outputs)."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
                 attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, args: object,
                 sp_size: int,
                 sp_rank: int) -> None:
        super().__init__()
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        global_seq_len = tokens.shape[1]
        fpdt_chunk = int(args.ds_sequence_parallel_fpdt_chunk_size)
        if global_seq_len % sp_size or global_seq_len % fpdt_chunk or (global_seq_len // sp_size) % (
                global_seq_len // fpdt_chunk):
            raise ValueError(f"FPDT: a sequence of {global_seq_len} tokens does not cut into chunks of {fpdt_chunk} "
                             f"over {sp_size} ranks (each rank's share must hold a whole number of chunks)")
        self.num_chunk_per_gpu = global_seq_len // fpdt_chunk
        self.local_seq_len = global_seq_len // sp_size
        self.chunk_size = self.local_seq_len // self.num_chunk_per_gpu
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.global_seq_len, self.batch_size, self.device = global_seq_len, tokens.shape[0], tokens.device

    def _order(self) -> torch.Tensor:
        """Token indices, rank by rank: rank r's chunks r, r + P, ... in turn."""
        chunks = torch.arange(self.global_seq_len, device=self.device).view(-1, self.chunk_size)
        return chunks.view(self.num_chunk_per_gpu, self.sp_size, self.chunk_size).transpose(0, 1).reshape(-1)

    def generate(self) -> tuple:
        order = self._order()
        mine = order.view(self.sp_size, -1)[self.sp_rank]
        pick = (lambda t: t[:, mine] if t is not None else None)
        loss_mask = self.loss_mask[:, order] if self.loss_mask is not None else None
        return pick(self.tokens), pick(self.labels), loss_mask, self.attention_mask, pick(self.position_ids)


class SequenceChunk:
    """One chunk kept for later: on an accelerator a host copy (pinned through the accelerator), on the device
    only between :meth:`load_to_gpu` and :meth:`offload`; a host tensor is kept as it is."""

    def __init__(self, chunk: torch.Tensor, device: torch.device | str | None = None, is_in_use: bool = False) -> None:
        self.chunk_shape, self.chunk_dtype = chunk.shape, chunk.dtype
        self.device = chunk.device if device is None else torch.device(device)
        accelerator = get_accelerator()
        if accelerator.on_accelerator(chunk) and not accelerator.is_synchronized_device():
            host = accelerator.pin_memory(torch.empty(chunk.shape, dtype=chunk.dtype, device="cpu"), make_copy=False)
            host.copy_(chunk)
            self.cpu_chunk = host
        else:
            self.cpu_chunk = chunk
        self.gpu_chunk = chunk if is_in_use else None

    def load_to_gpu(self) -> None:
        if self.gpu_chunk is not None:
            raise RuntimeError("SequenceChunk.load_to_gpu: the chunk is on the device already")
        self.gpu_chunk = self.cpu_chunk.to(self.device)

    def get_gpu_chunk(self) -> torch.Tensor:
        self.check_gpu_chunk()
        return self.gpu_chunk

    def check_gpu_chunk(self) -> bool:
        if self.gpu_chunk is None or self.gpu_chunk.device != self.device:
            raise RuntimeError(f"SequenceChunk: the chunk should be on {self.device}; load_to_gpu() first")
        return True

    def offload(self) -> None:
        self.check_gpu_chunk()
        self.gpu_chunk = None

    def overwrite_to_cpu(self) -> None:
        self.check_gpu_chunk()
        self.cpu_chunk.copy_(self.gpu_chunk)


def _use(chunk: SequenceChunk) -> torch.Tensor:
    """The chunk on its device (loaded when it waits in host memory)."""
    if chunk.gpu_chunk is None:
        chunk.load_to_gpu()
    return chunk.gpu_chunk


def _keep(tensor: torch.Tensor) -> SequenceChunk:
    """Keep ``tensor`` for backward (in use now; :func:`_release` leaves only its host copy when offloading)."""
    return SequenceChunk(tensor, is_in_use=True)


def _release(chunk: SequenceChunk, offload: bool) -> None:
    if offload and chunk.gpu_chunk is not None and chunk.cpu_chunk is not chunk.gpu_chunk:
        chunk.offload()


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``[b, h, s_q, s_k]`` fp32 (fp64 for fp64) scores of ``[b, s, h, d]`` q and k (k's heads repeated for grouped queries),
    the upper triangle masked when ``causal``."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2) if k.shape[2] != q.shape[2] else k
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k.to(acc)) * scale
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    return scores


def _heads(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.repeat_interleave(like.shape[2] // v.shape[2], dim=2) if v.shape[2] != like.shape[2] else v


def _fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient over repeated key/value heads summed back onto the ``heads`` they repeat."""
    if grad.shape[2] == heads:
        return grad
    b, s, h, d = grad.shape
    return grad.view(b, s, heads, h // heads, d).sum(3)


class _FPDTGPUOffloadingAttentionImpl_(torch.autograd.Function):
    """FPDT's attention (module docstring), DeepSpeed's argument list: ``apply(layernorm_output [l, b, hidden],
    attention_mask (None), inference_params, rotary_pos_emb (None or (cos, sin) ``[s, b, 1, d]``), spg,
    scatter_idx, gather_idx, hidden_size, projection_size, hidden_size_per_attention_head, kv_projection_size,
    qkv_linear_weight, qkv_linear_bias, dropout (0), num_chunks, cpu_offloading)`` -> ``[b, l, heads, head_dim]``."""

    @staticmethod
    def forward(ctx: FunctionCtx, layernorm_output: torch.Tensor, attention_mask: torch.Tensor | None,
                inference_params: object, rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None,
                spg: comm.ProcessGroup, scatter_idx: int, gather_idx: int, hidden_size: int,
                projection_size: int, hidden_size_per_attention_head: int, kv_projection_size: int,
                qkv_linear_weight: torch.Tensor, qkv_linear_bias: torch.Tensor, dropout: float, num_chunks: int = 8,
                cpu_offloading: bool = True) -> torch.Tensor:
        if attention_mask is not None or dropout:
            raise ValueError("FPDT attention is causal without dropout: pass attention_mask=None and dropout=0")
        length = layernorm_output.shape[0]
        if length % num_chunks:
            raise ValueError(f"FPDT: {length} local tokens do not cut into num_chunks={num_chunks} equal chunks")
        chunk = length // num_chunks
        head_dim = hidden_size_per_attention_head
        ctx.cos, ctx.sin = ((rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3))
                            if rotary_pos_emb is not None else (None, None))
        ctx.spg, ctx.num_chunks, ctx.offload = spg, num_chunks, cpu_offloading
        ctx.sizes = (projection_size, kv_projection_size, head_dim)
        ctx.scale, ctx.dtype = head_dim ** -0.5, layernorm_output.dtype
        ctx.acc = torch.promote_types(ctx.dtype, torch.float32)  # what blocks are computed in
        inputs, qs, ks, vs, outs, lses, final = [], [], [], [], [], [], []
        with torch.no_grad():
            for i in range(num_chunks):
                x = layernorm_output[i * chunk:(i + 1) * chunk]
                inputs.append(_keep(x))
                q, k, v = _FPDTGPUOffloadingAttentionImpl_._project(ctx, x, qkv_linear_weight, qkv_linear_bias, i)
                qs.append(_keep(q))
                ks.append(_keep(k))
                vs.append(_keep(v))
                out = lse = None
                for j in range(i + 1):
                    scores = _scores(q, _use(ks[j]), ctx.scale, causal=i == j)
                    block_lse = torch.logsumexp(scores, dim=-1)  # [b, h, s]
                    block_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), _heads(_use(vs[j]).to(ctx.acc), q))
                    out, lse = update_out_and_lse(out, lse, block_out, block_lse)
                    if j != i:
                        _release(ks[j], cpu_offloading)
                        _release(vs[j], cpu_offloading)
                for kept in (qs[i], ks[i], vs[i], inputs[i]):
                    _release(kept, cpu_offloading)
                outs.append(_keep(out.to(ctx.dtype)))
                lses.append(_keep(lse[..., 0].permute(0, 2, 1).contiguous()))  # [b, h, s]
                final.append(single_all_to_all(out.to(ctx.dtype).contiguous(), 1, 2, None, spg))
        ctx.saved = (inputs, qs, ks, vs, outs, lses)
        ctx.save_for_backward(qkv_linear_weight, qkv_linear_bias)
        return torch.cat(final, dim=1)

    @staticmethod
    def _project(ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, index: int) -> tuple:
        """Local chunk ``index``'s q, k, v ``[b, P * c, heads / P, head_dim]`` (exchanged: global block
        ``index``; its rotary positions applied)."""
        projection, kv_projection, head_dim = ctx.sizes
        qkv = x @ weight.t() + bias  # [c, b, proj + 2 kv]
        parts = (qkv[..., :projection], qkv[..., projection:projection + kv_projection],
                 qkv[..., projection + kv_projection:])
        q, k, v = (single_all_to_all(p.reshape(p.shape[0], p.shape[1], -1, head_dim).permute(1, 0, 2, 3).contiguous(),
                                     2, 1, None, ctx.spg) for p in parts)
        if ctx.cos is not None:
            block = slice(q.shape[1] * index, q.shape[1] * (index + 1))
            cos, sin = ctx.cos[:, block], ctx.sin[:, block]
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        return q, k, v

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple:
        weight, bias = ctx.saved_tensors
        inputs, qs, ks, vs, outs, lses = ctx.saved
        n, chunk = ctx.num_chunks, grad_output.shape[1] // ctx.num_chunks
        grad_out = [single_all_to_all(grad_output[:, i * chunk:(i + 1) * chunk].contiguous(), 2, 1, None, ctx.spg)
                    .to(ctx.acc) for i in range(n)]  # [b, P c, h / P, d] per block
        delta = [(grad_out[i] * _use(outs[i]).to(ctx.acc)).sum(-1).transpose(1, 2) for i in range(n)]  # [b, h, s]
        dq = [None] * n
        grad_input, grad_weight, grad_bias = [], torch.zeros_like(weight, dtype=ctx.acc), torch.zeros(
            bias.shape, dtype=ctx.acc, device=bias.device)
        for j in range(n):
            k, v = _use(ks[j]).to(ctx.acc), _use(vs[j]).to(ctx.acc)
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            for i in range(j, n):
                q = _use(qs[i]).to(ctx.acc)
                probs = torch.exp(_scores(q, k, ctx.scale, causal=i == j) - _use(lses[i]).to(ctx.acc).unsqueeze(-1))
                dv += _fold_heads(torch.einsum("bhqk,bqhd->bkhd", probs, grad_out[i]), v.shape[2])
                dprobs = torch.einsum("bqhd,bkhd->bhqk", grad_out[i], _heads(v, q))
                dscores = probs * (dprobs - delta[i].unsqueeze(-1)) * ctx.scale
                contribution = torch.einsum("bhqk,bkhd->bqhd", dscores, _heads(k, q))
                dq[i] = contribution if dq[i] is None else dq[i] + contribution
                dk += _fold_heads(torch.einsum("bhqk,bqhd->bkhd", dscores, q), k.shape[2])
                if i != j:
                    _release(qs[i], ctx.offload)
            if ctx.cos is not None:
                block = k.shape[1]
                cos, sin = ctx.cos[:, block * j:block * (j + 1)], ctx.sin[:, block * j:block * (j + 1)]
                dq[j], dk = apply_rotary_pos_emb_backward(dq[j], cos, sin), apply_rotary_pos_emb_backward(dk, cos, sin)
            # block j's gradients are final: back to this rank's sequence chunk, [c, b, heads * head_dim]
            back = [single_all_to_all(g.to(ctx.dtype).contiguous(), 1, 2, None, ctx.spg).flatten(2).permute(1, 0, 2)
                    .to(ctx.acc) for g in (dq[j], dk, dv)]
            dq[j] = None
            dqkv = torch.cat(back, dim=-1)  # [c, b, proj + 2 kv]
            x = _use(inputs[j]).to(ctx.acc)
            grad_weight += dqkv.reshape(-1, dqkv.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            grad_bias += dqkv.sum((0, 1))
            grad_input.append(dqkv @ weight.to(ctx.acc))
            for kept in (qs[j], ks[j], vs[j], inputs[j], outs[j], lses[j]):
                _release(kept, ctx.offload)
        return (torch.cat(grad_input, dim=0).to(ctx.dtype), None, None, None, None, None, None, None, None, None,
                None, grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None, None, None)
