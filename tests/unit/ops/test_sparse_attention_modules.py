"""The sparse-attention modules keep DeepSpeed's interfaces: SparseSelfAttention, BertSparseSelfAttention,
the causal form the GPT uses, and SparseAttentionUtils on BERT/RoBERTa-shaped models and dsrun's GPT."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.models import GPT
from dsrun.ops.sparse_attention import (BertSparseSelfAttention, BSLongformerSparsityConfig,
                                        CausalSparseSelfAttention, DenseSparsityConfig, FixedSparsityConfig,
                                        SparseAttentionUtils, SparseSelfAttention)
from tests.unit.ops.test_block_sparse import DEVICES, dense_reference, element_mask, qkv, rounding_bound


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_self_attention_takes_deepspeeds_arguments(device):
    random.seed(0)
    config = FixedSparsityConfig(num_heads=2, block=8, num_local_blocks=2)
    module = SparseSelfAttention(config, max_seq_length=64).to(device)
    assert torch.equal(module.master_layout.cpu(), config.make_layout(64))
    assert torch.equal(module.get_layout(32), module.master_layout[..., :4, :4].cpu())
    q, k, v = qkv((2, 2, 32, 8), device=device)
    padding = torch.zeros(2, 1, 1, 32, dtype=torch.float64, device=device)  # BERT's extended mask, squeezed
    padding[1, ..., -8:] = -1e4
    out = module(q, k.transpose(-1, -2), v, key_padding_mask=padding)  # keys may come transposed
    ref = dense_reference(q, k, v, element_mask(module.get_layout(32), 8, False), key_padding=padding[:, 0, 0])
    assert (out - ref).abs().max() <= rounding_bound(q, k, v, 32, torch.float64)
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        module(q[:, :, :30], k[:, :, :30], v[:, :, :30])
    with pytest.raises(ValueError, match="exceeds max_seq_length 64"):
        module.get_layout(72)
    with pytest.raises(NotImplementedError, match="only self-attention"):
        module(q, k[:, :1], v)


def test_a_changed_layout_buffer_is_used_at_once():
    """The engine broadcasts rank 0's buffers in place, and a checkpoint load copies into them: the cached
    block list must follow the buffer, not the layout it was built from."""
    module = SparseSelfAttention(DenseSparsityConfig(num_heads=1, block=4), max_seq_length=16)
    q, k, v = qkv((1, 1, 16, 4))
    dense = module(q, k, v)
    with torch.no_grad():
        module.master_layout.copy_(torch.eye(4, dtype=torch.int64))  # each block attends to itself only
    local = module(q, k, v)
    assert not torch.allclose(dense, local)
    assert torch.allclose(local, dense_reference(q, k, v, element_mask(torch.eye(4)[None], 4, False)))


class PlainBertSelfAttention(nn.Module):
    """BERT's self-attention written out: projections, scores + additive mask, softmax, context."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden).double() for _ in range(3))

    def forward(self, hidden_states, attention_mask):
        batch, seq, hidden = hidden_states.shape
        q, k, v = (proj(hidden_states).view(batch, seq, self.heads, -1).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / (hidden // self.heads) ** 0.5 + attention_mask
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(batch, seq, hidden)


def fake_bert(layers: int = 2, hidden: int = 16, heads: int = 2, positions: int = 32, roberta: bool = False):
    """A module shaped like a Hugging Face BERT/RoBERTa as far as SparseAttentionUtils looks."""
    config = SimpleNamespace(hidden_size=hidden, num_attention_heads=heads, max_position_embeddings=positions)
    encoder = SimpleNamespace(layer=[
        SimpleNamespace(attention=SimpleNamespace(self=PlainBertSelfAttention(hidden, heads))) for _ in range(layers)])
    body = SimpleNamespace(embeddings=SimpleNamespace(position_embeddings=nn.Embedding(positions, hidden)),
                           encoder=encoder)
    model = nn.Module()
    model.config = config
    setattr(model, "roberta" if roberta else "bert", body)
    return model


def test_bert_sparse_self_attention_with_a_dense_layout_is_bert_self_attention():
    torch.manual_seed(0)
    bert = PlainBertSelfAttention(hidden=16, heads=2)
    sparse = BertSparseSelfAttention(SimpleNamespace(hidden_size=16, num_attention_heads=2),
                                     DenseSparsityConfig(num_heads=2, block=8)).double()
    sparse.query, sparse.key, sparse.value = bert.query, bert.key, bert.value
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    mask = torch.zeros(2, 1, 1, 24, dtype=torch.float64)
    mask[0, ..., -3:] = -10000.0
    assert torch.allclose(sparse(x, mask), bert(x, mask), atol=1e-12)
    with pytest.raises(ValueError, match="not a multiple of num_attention_heads"):
        BertSparseSelfAttention(SimpleNamespace(hidden_size=10, num_attention_heads=4))


def test_replacing_bert_self_attention_keeps_the_trained_projections():
    model = fake_bert()
    old = [layer.attention.self for layer in model.bert.encoder.layer]
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, FixedSparsityConfig(num_heads=2, block=8))
    assert model.config.max_position_embeddings == 64
    for layer, before in zip(model.bert.encoder.layer, old):
        assert isinstance(layer.attention.self, BertSparseSelfAttention)
        assert layer.attention.self.query is before.query and layer.attention.self.value is before.value
    roberta = fake_bert(roberta=True)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        roberta, 64, FixedSparsityConfig(num_heads=2, block=8))
    assert roberta.config.max_position_embeddings == 66  # RoBERTa reserves two positions
    with pytest.raises(ValueError, match="supports BERT"):
        SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(nn.Linear(2, 2), 64, None)


def test_extending_position_embeddings_repeats_the_trained_rows():
    model = fake_bert(positions=6)
    table = model.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 16)
    extended = model.bert.embeddings.position_embeddings.weight
    assert extended.shape == (16, 16) and model.config.max_position_embeddings == 16
    assert torch.equal(extended[:12], table.repeat(2, 1)) and torch.equal(extended[12:], table[:4])
    roberta = fake_bert(positions=6, roberta=True)
    table = roberta.roberta.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(roberta, 8)
    extended = roberta.roberta.embeddings.position_embeddings.weight
    assert extended.shape == (10, 16) and torch.equal(extended[:2], table[:2])
    assert torch.equal(extended[2:6], table[2:]) and torch.equal(extended[6:], table[2:])
    with pytest.raises(ValueError, match="must exceed"):
        SparseAttentionUtils.extend_position_embedding(fake_bert(positions=6), 4)


def test_padding_to_the_block_size_and_back():
    ids = torch.arange(10).view(2, 5)
    pad_len, ids_p, mask_p, types_p, pos_p, embeds_p = SparseAttentionUtils.pad_to_block_size(
        4, ids, torch.ones(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), None, None,
        pad_token_id=99, model_embeddings=None)
    assert pad_len == 3 and ids_p.shape == (2, 8) and (ids_p[:, 5:] == 99).all()
    assert mask_p[:, 5:].sum() == 0 and types_p.shape == (2, 8) and pos_p is None and embeds_p is None
    embeddings = nn.Embedding(100, 3)
    _, _, _, _, _, embeds = SparseAttentionUtils.pad_to_block_size(4, None, None, None, None, torch.zeros(2, 5, 3),
                                                                   99, embeddings)
    assert torch.equal(embeds[:, 5:], embeddings(torch.full((2, 3), 99)))
    out = torch.randn(2, 8, 3)
    assert torch.equal(SparseAttentionUtils.unpad_sequence_output(pad_len, out), out[:, :5])
    assert SparseAttentionUtils.unpad_sequence_output(0, out) is out


@pytest.mark.parametrize("device", DEVICES)
def test_causal_sparse_attention_takes_any_length_and_never_looks_ahead(device):
    q, k, v = qkv((2, 2, 45, 8), dtype=torch.float32, device=device)
    dense = CausalSparseSelfAttention(DenseSparsityConfig(num_heads=2, block=16), max_seq_length=45).to(device)
    assert dense.master_layout.shape == (2, 3, 3)  # 45 tokens -> 3 blocks of 16
    out = dense(q, k, v)
    assert (out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() <= 2 * rounding_bound(
        q, k, v, 45, torch.float32)
    # a bidirectional layout stays causal: changing the last key moves no earlier output
    window = CausalSparseSelfAttention(BSLongformerSparsityConfig(2, block=16), max_seq_length=45).to(device)
    k2 = k.detach().clone()
    k2[:, :, -1] += 1.0
    assert torch.equal(window(q, k, v)[:, :, :-1], window(q, k2, v)[:, :, :-1])


def test_replacing_gpt_attention_with_a_dense_layout_keeps_its_outputs():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16).double()
    tokens = torch.randint(0, 64, (2, 32))
    before = model(tokens)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 32, DenseSparsityConfig(num_heads=2, block=8))
    assert all(isinstance(block.attn.sparse, CausalSparseSelfAttention) for block in model.transformer["h"])
    # float64: the two paths differ by rounding only (sums of at most 64 terms of size ~1: ~1e-14)
    assert torch.allclose(model(tokens), before, rtol=0, atol=1e-12)
    table = model.transformer["wpe"].weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 80)
    assert model.config.block_size == 80 and torch.equal(model.transformer["wpe"].weight[32:64], table)
