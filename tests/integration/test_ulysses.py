"""DeepSpeed-Ulysses ``DistributedAttention`` on gloo ranks: each rank's output shard and its q/k/v gradients
equal single-process attention over the whole sequence (sliced), in both layouts, and each exchange moves
exactly (P - 1)/P of the tensor per rank. In the refusal's launch, 3 heads over 2 ranks (DeepSpeed's uneven
heads: output and gradients as one process's), AutoSP's ViT wrapper over uneven shards (output and patch
gradients as one process's) and its LLaVA splice."""
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


def vit_attention(x: torch.Tensor) -> torch.Tensor:
    """Non-causal softmax self-attention over the whole sequence (a ViT block's, without weights)."""
    return (x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1])).softmax(-1) @ x


def vit_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(2, 1 + 5, 4, generator=gen, dtype=torch.float64), torch.randn(2, 6, 4, generator=gen,
                                                                                     dtype=torch.float64)


def uneven_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(13)
    return [torch.randn(6, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(4)]  # q k v, dout


FPDT_LEN, FPDT_BATCH, FPDT_HEADS, FPDT_HEAD_DIM, FPDT_CHUNK = 16, 2, 4, 4, 4  # 4 chunks of 2 tokens per rank


class FpdtArgs:
    ds_sequence_parallel_fpdt_chunk_size = FPDT_CHUNK


def fpdt_inputs() -> list[torch.Tensor]:
    """x [L, b, hidden], the qkv weight and bias, the output gradient [b, L, heads, head_dim], rotary cos/sin."""
    gen = torch.Generator().manual_seed(17)
    hidden = FPDT_HEADS * FPDT_HEAD_DIM
    x = torch.randn(FPDT_LEN, FPDT_BATCH, hidden, generator=gen, dtype=torch.float64)
    weight = torch.randn(3 * hidden, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5
    bias = torch.randn(3 * hidden, generator=gen, dtype=torch.float64)
    dout = torch.randn(FPDT_BATCH, FPDT_LEN, FPDT_HEADS, FPDT_HEAD_DIM, generator=gen, dtype=torch.float64)
    angles = torch.arange(FPDT_LEN, dtype=torch.float64)[:, None] * torch.tensor([1.0, 0.3, 1.0, 0.3])
    return [x, weight, bias, dout, angles.cos().view(FPDT_LEN, 1, 1, -1), angles.sin().view(FPDT_LEN, 1, 1, -1)]


def fpdt_reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Causal attention over the whole sequence, one process: the output [b, L, h, d] and the gradients of x,
    the weight and the bias for the loss sum(out * dout)."""
    from dsrun.sequence.layer import apply_rotary_pos_emb

    x, weight, bias, dout, cos, sin = fpdt_inputs()
    x, weight, bias = (t.clone().requires_grad_() for t in (x, weight, bias))
    q, k, v = (t.reshape(FPDT_LEN, FPDT_BATCH, FPDT_HEADS, FPDT_HEAD_DIM).transpose(0, 1)
               for t in (x @ weight.t() + bias).chunk(3, dim=-1))
    q, k = (apply_rotary_pos_emb(t, cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)) for t in (q, k))
    out = causal_attention(q, k, v, seq_dim=1)
    (out * dout).sum().backward()
    return out.detach(), [x.grad, weight.grad, bias.grad]


def fpdt_rank(rank: int, world: int) -> dict:
    """FPDT's chunked, offloaded attention on this rank's load-balanced share (DeepSpeed's layout)."""
    from dsrun.sequence.fpdt import FPDT_InputConstruct, _FPDTGPUOffloadingAttentionImpl_

    x, weight, bias, dout, cos, sin = fpdt_inputs()
    share = lambda t: FPDT_InputConstruct(t, None, None, None, None, FpdtArgs(), world, rank).generate()[0]  # noqa
    local = share(x.transpose(0, 1)).transpose(0, 1).contiguous().requires_grad_()
    weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    hidden = FPDT_HEADS * FPDT_HEAD_DIM
    chunks = local.shape[0] * world // FPDT_CHUNK
    out = _FPDTGPUOffloadingAttentionImpl_.apply(local, None, None, (cos, sin), None, 2, 0, hidden, hidden,
                                                 FPDT_HEAD_DIM, hidden, weight, bias, 0, chunks, True)
    (out * share(dout)).sum().backward()
    return {"out": out.detach(), "x_grad": local.grad, "weight_grad": weight.grad, "bias_grad": bias.grad}


def hf_llama() -> torch.nn.Module:
    """A 2-layer Llama (4 query heads, 1 key/value head: repeated over the 2 ranks), float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=32, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(config).double()


HF_IDS = [[1, 5, 7, 9, 11, 3, 2, 4], [1, 20, 20, 20, 2, 2, 6, 6]]


def ulysses_hf_rank(rank: int, world: int) -> dict:
    """ALST's Hugging Face Ulysses: the adapter's shards of rank 0's sample, and the loss and a gradient of a Llama
    through the wrapped sdpa attention (each rank's share of the token-weighted loss; gradients summed)."""
    from dsrun import comm
    from dsrun.sequence.ulysses_hf import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    model = hf_llama()
    ids = torch.tensor(HF_IDS)
    data = torch.utils.data.TensorDataset(ids, torch.arange(8).repeat(2, 1))
    collate = lambda b: {"input_ids": b[0][0][None], "position_ids": b[0][1][None], "labels": b[0][0][None]}  # noqa
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, seq_length_is_variable=True)
    loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(data, batch_size=1, collate_fn=collate),
                                        mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group(), world,
                                        "cpu")
    batch = next(loader)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = model.loss_function(logits=logits, labels=None, shift_labels=batch["shift_labels"], vocab_size=32)
    good = (batch["shift_labels"] != -100).sum()
    total = good.clone()
    comm.all_reduce(total)
    share = loss * good / total
    share.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    comm.all_reduce(grad)
    return {"batch": batch, "loss_share": share.detach(), "grad": grad, "length": len(loader)}


def refusal_and_autosp(rank: int, world: int) -> dict:
    from dsrun import comm
    from dsrun.sequence.autosp_fusion import LlavaFusionAdapter
    from dsrun.sequence.autosp_vit import UlyssesSPViTAttention
    from dsrun.sequence.layer import DistributedAttention

    comm.init_distributed(dist_backend="gloo")
    try:
        try:
            x = torch.zeros(4, 1, 1, 2)  # 1 head over 2 ranks
            DistributedAttention(lambda a, b, c: a, None)(x, x, x)
            message = "no error"
        except ValueError as err:
            message = str(err)
        # 3 heads over 2 ranks: 2 + 1 (DeepSpeed's uneven heads), output and gradients as one process's
        q, k, v, d = uneven_inputs()
        shard = q.shape[0] // world
        piece = [t[rank * shard:(rank + 1) * shard].clone().requires_grad_() for t in (q, k, v)]
        uneven = DistributedAttention(lambda a, b, c: causal_attention(a, b, c, 0), None)(*piece)
        (uneven * d[rank * shard:(rank + 1) * shard]).sum().backward()
        # AutoSP: 5 patches and a [CLS] token over 2 ranks (3 + 2 patches), through a non-causal attention
        full, dout = vit_inputs()
        start, count = (0, 3) if rank == 0 else (3, 2)
        pick = [0, *range(1 + start, 1 + start + count)]
        local = full[:, pick].clone().requires_grad_()
        attention = type("Attention", (torch.nn.Module,), {"forward": lambda self, h: vit_attention(h)})()
        out = UlyssesSPViTAttention(attention, None, has_cls_token=True)(local)
        (out * dout[:, pick]).sum().backward()
        # LLaVA: 2 visual tokens per rank spliced at the placeholder of 6 text tokens: 9 fused, padded to 10
        visual = torch.arange(16, dtype=torch.float64).reshape(1, 4, 4)
        text, ids = -torch.ones(1, 6, 4, dtype=torch.float64), torch.zeros(1, 6, dtype=torch.long)
        ids[0, 1] = -200
        fused = LlavaFusionAdapter(torch.nn.Identity(), None)(visual[:, 2 * rank:2 * rank + 2], text, ids)
        return {"message": message, "out": out.detach().numpy(), "patch_grad": local.grad[:, 1:].numpy(),
                "fused": fused.numpy(), "uneven": uneven.detach().numpy(), "uneven_grads": [p.grad.numpy() for p in piece],
                "fpdt": fpdt_rank(rank, world), "hf": ulysses_hf_rank(rank, world)}
    finally:
        comm.destroy_process_group()


def test_uneven_heads_split_fewer_heads_than_ranks_are_refused_and_autosp_gathers_uneven_shards():
    ranks = run_ranks(refusal_and_autosp, 2, timeout=60)
    for got in ranks:
        assert "size 1 does not split over 2 sequence-parallel ranks: it needs at least 2" in got["message"]
    q, k, v, d = (t.clone().requires_grad_() for t in uneven_inputs())
    ref = causal_attention(q, k, v, 0)
    (ref * d).sum().backward()
    for rank, got in enumerate(ranks):  # float64, the same arithmetic per head: exact up to summation order
        rows = slice(3 * rank, 3 * rank + 3)
        assert np.allclose(got["uneven"], ref.detach()[rows].numpy(), rtol=0, atol=1e-12)
        for g, r in zip(got["uneven_grads"], (q, k, v)):
            assert np.allclose(g, r.grad[rows].numpy(), rtol=0, atol=1e-12)
    # the reference: one process, the whole sequence; each rank's output is the [CLS] row and its patches, and
    # the [CLS] output is used on both ranks (so counted twice in the loss)
    full, dout = vit_inputs()
    x = full.clone().requires_grad_()
    y = vit_attention(x)
    ((y * dout).sum() + (y[:, :1] * dout[:, :1]).sum()).backward()
    for rank, (start, count) in enumerate([(0, 3), (3, 2)]):
        pick = [0, *range(1 + start, 1 + start + count)]
        # the same float64 arithmetic on the same numbers: only the gather's concatenation differs (exact)
        assert np.allclose(ranks[rank]["out"], y.detach()[:, pick].numpy(), rtol=0, atol=1e-12)
        # every rank's output reaches the patches it came from: the gradient sums both ranks' shares
        assert np.allclose(ranks[rank]["patch_grad"], x.grad[:, 1 + start:1 + start + count].numpy(), rtol=0,
                           atol=1e-12)
    # FPDT: each rank's load-balanced share of the output and of x's gradient, and the ranks' weight and bias
    # gradients summed, equal one process's (float64; only the summation order differs)
    from dsrun.sequence.fpdt import FPDT_InputConstruct

    out, (x_grad, weight_grad, bias_grad) = fpdt_reference()
    for rank, got in enumerate(ranks):
        share = lambda t: FPDT_InputConstruct(t, None, None, None, None, FpdtArgs(), 2, rank).generate()[0]  # noqa
        torch.testing.assert_close(got["fpdt"]["out"], share(out), rtol=0, atol=1e-12)
        torch.testing.assert_close(got["fpdt"]["x_grad"], share(x_grad.transpose(0, 1)).transpose(0, 1), rtol=0,
                                   atol=1e-12)
    torch.testing.assert_close(sum(got["fpdt"]["weight_grad"] for got in ranks), weight_grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(sum(got["fpdt"]["bias_grad"] for got in ranks), bias_grad, rtol=0, atol=1e-11)
    # ALST's Hugging Face Ulysses: rank r holds half of rank 0's sample, labels shifted before the cut; the token-
    # weighted loss shares add up to one process's loss, and the q projection's gradient (summed) equals its
    model = hf_llama()
    ids = torch.tensor(HF_IDS[:1])
    ref = model(input_ids=ids, position_ids=torch.arange(8)[None], labels=ids)
    ref.loss.backward()
    shifted = torch.tensor([[5, 7, 9, 11, 3, 2, 4, -100]])
    for rank, got in enumerate(ranks):
        half = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(got["hf"]["batch"]["input_ids"], ids[:, half]) and got["hf"]["length"] == 4
        assert torch.equal(got["hf"]["batch"]["position_ids"], torch.arange(8)[None, half])
        assert torch.equal(got["hf"]["batch"]["shift_labels"], shifted[:, half])
    torch.testing.assert_close(sum(got["hf"]["loss_share"] for got in ranks), ref.loss.detach(), rtol=0, atol=1e-12)
    for got in ranks:
        torch.testing.assert_close(got["hf"]["grad"], model.model.layers[0].self_attn.q_proj.weight.grad, rtol=0,
                                   atol=1e-12)
    visual = torch.arange(16, dtype=torch.float64).reshape(1, 4, 4)
    want = torch.cat([-torch.ones(1, 1, 4), visual, -torch.ones(1, 4, 4), torch.zeros(1, 1, 4)], dim=1)
    assert np.array_equal(np.concatenate([got["fused"] for got in ranks], axis=1), want.numpy())
