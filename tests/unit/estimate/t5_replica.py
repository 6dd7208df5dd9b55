"""A parameter-for-parameter replica of Hugging Face's ``T5Model`` layout, for the estimator oracles.

The DeepSpeed documentation's "live" tables were printed for ``AutoModel.from_pretrained("t5-3b")``. We
cannot download it here, and do not need to: the estimators only see parameter shapes, so a module tree
with the same shapes (built on the meta device, so it costs no memory) reproduces the counts exactly:
t5-3b has 2,851,598,336 parameters and its largest layer is the shared 32128 x 1024 embedding.
"""
from __future__ import annotations

import torch
from torch import nn


class _Norm(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))


class _Attention(nn.Module):
    def __init__(self, d_model: int, inner: int, relative_bias: bool, buckets: int, heads: int):
        super().__init__()
        self.q = nn.Linear(d_model, inner, bias=False)
        self.k = nn.Linear(d_model, inner, bias=False)
        self.v = nn.Linear(d_model, inner, bias=False)
        self.o = nn.Linear(inner, d_model, bias=False)
        if relative_bias:
            self.relative_attention_bias = nn.Embedding(buckets, heads)


class _Block(nn.Module):
    def __init__(self, d_model: int, d_ff: int, inner: int, heads: int, buckets: int, first: bool,
                 decoder: bool):
        super().__init__()
        self.self_attention = _Attention(d_model, inner, first, buckets, heads)
        self.self_norm = _Norm(d_model)
        if decoder:
            self.cross_attention = _Attention(d_model, inner, False, buckets, heads)
            self.cross_norm = _Norm(d_model)
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.ff_norm = _Norm(d_model)


class _Stack(nn.Module):
    def __init__(self, shared: nn.Embedding, layers: int, decoder: bool, **dims: int):
        super().__init__()
        self.embed_tokens = shared  # tied: the same module object as the model's shared embedding
        self.block = nn.ModuleList(_Block(first=i == 0, decoder=decoder, **dims) for i in range(layers))
        self.final_layer_norm = _Norm(dims["d_model"])


class T5ModelReplica(nn.Module):
    def __init__(self, vocab: int = 32128, d_model: int = 1024, d_ff: int = 16384, heads: int = 32,
                 d_kv: int = 128, layers: int = 24, buckets: int = 32):
        super().__init__()
        self.shared = nn.Embedding(vocab, d_model)
        dims = dict(d_model=d_model, d_ff=d_ff, inner=heads * d_kv, heads=heads, buckets=buckets)
        self.encoder = _Stack(self.shared, layers, decoder=False, **dims)
        self.decoder = _Stack(self.shared, layers, decoder=True, **dims)


def t5_3b_on_meta() -> T5ModelReplica:
    with torch.device("meta"):
        return T5ModelReplica()


def t5_large_on_meta() -> T5ModelReplica:
    with torch.device("meta"):
        return T5ModelReplica(d_model=1024, d_ff=4096, heads=16, d_kv=64, layers=24)
