"""A small nanoGPT-style decoder for the estimator tests (the project's GPT lives in dsrun.models).

It has the same GPTConfig field names as ``dsrun.models.gpt`` and exposes ``model.config``, so the
estimator reads its shape the same way; ``flash`` picks fused (SDPA) or explicit softmax attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyGPTConfig:
    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True


class Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.mlp_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        a = self.cfg.n_head
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, a, h // a).transpose(1, 2) for t in (q, k, v))
        if self.cfg.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int = 512, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64, dropout: float = 0.0, bias: bool = True, flash: bool = True):
        super().__init__()
        self.config = cfg = TinyGPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, flash)
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
