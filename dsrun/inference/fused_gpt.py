"""Kernel injection for dsrun's GPT: one fused inference forward with a KV cache.

``replace_with_kernel_inject=True`` on a :class:`dsrun.models.gpt.GPT` swaps its per-module forward for
:class:`FusedGPT`, which reads the same (possibly tensor-parallel, possibly INT8) weights and

- keeps a key/value cache of ``min(max_out_tokens, block_size)`` positions per layer, so generating a token
  runs the blocks on that one token instead of on the whole sequence again;
- runs attention with ``scaled_dot_product_attention`` (causal on the prompt unless
  ``triangular_masking=False``; a new token attends to every cached position);
- has no dropout and no activation-checkpointing branch on the way.

A full forward (``engine(idx)``, ``engine(idx, targets)``) takes the same path without a cache and returns
what the GPT returns. On the prompt the operations are the GPT's own, so the logits are the same; later
tokens attend over cached keys, which sums in another order (equal within fp32 rounding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.models.gpt import GPT, IGNORE_INDEX, sample_next_token
from dsrun.models.layers import apply_rotary, rotary_cos_sin
from dsrun.utils.errors import Problem, UserError


@dataclass
class KVCache:
    """Keys and values of every layer, ``[layer, batch, heads, capacity, head_size]``."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, batch: int, heads: int, capacity: int, head_size: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (layers, batch, heads, capacity, head_size)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class FusedGPT(nn.Module):
    """The fused inference forward of a dsrun GPT (its weights are shared, not copied)."""

    def __init__(self, gpt: GPT, max_out_tokens: int = 1024, min_out_tokens: int = 1, causal: bool = True):
        super().__init__()
        if any(getattr(block.attn, "sparse", None) is not None for block in gpt.transformer["h"]):
            raise UserError(Problem("init_inference.replace_with_kernel_inject", "the fused path computes dense "
                                    "attention, but this GPT has sparse attention (model.attention=sparse)",
                                    "leave replace_with_kernel_inject off: the GPT's own forward is block-sparse"))
        self.gpt = gpt
        self.config = gpt.config
        self.capacity = min(max_out_tokens, gpt.config.block_size)
        self.min_out_tokens = min_out_tokens
        self.causal = causal

    # ------------------------------------------------------------------------------------------ forward
    def _attention(self, block: nn.Module, x: torch.Tensor, layer: int, cache: KVCache | None,
                   start: int) -> torch.Tensor:
        attn = block.attn
        batch, seq, _ = x.shape
        heads, head_size = attn.n_head, attn.head_size
        q, k, v = attn.c_attn(x).split(heads * head_size, dim=2)
        q, k, v = (t.view(batch, seq, heads, head_size).transpose(1, 2) for t in (q, k, v))
        if attn.rotary:
            cos, sin = rotary_cos_sin(start + seq, head_size, attn.rotary_base, x.device, q.dtype)
            q, k = apply_rotary(q, cos[start:], sin[start:]), apply_rotary(k, cos[start:], sin[start:])
        if cache is not None:
            cache.keys[layer, :, :, start:start + seq] = k
            cache.values[layer, :, :, start:start + seq] = v
            k, v = cache.keys[layer, :, :, :start + seq], cache.values[layer, :, :, :start + seq]
        # the prompt (start 0) is causal unless triangular_masking=False; after it, tokens come one at a
        # time and each attends to every cached position
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and start == 0 and seq > 1)
        return attn.c_proj(y.transpose(1, 2).reshape(batch, seq, heads * head_size))

    def _logits(self, idx: torch.Tensor, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """Logits of ``idx`` at positions ``start...``: the whole prompt at 0, then one token at a time."""
        if start > 0 and idx.shape[1] != 1:
            raise ValueError("after the prompt the fused path takes one token per call")
        transformer = self.gpt.transformer
        seq = idx.shape[1]
        x = transformer["wte"](idx)
        if "wpe" in transformer:
            x = x + transformer["wpe"](torch.arange(start, start + seq, device=idx.device))
        for layer, block in enumerate(transformer["h"]):
            x = x + self._attention(block, block.ln_1(x), layer, cache, start)
            mlp = block.mlp
            x = x + mlp.c_proj(F.gelu(mlp.c_fc(block.ln_2(x))))
        return self.gpt.lm_head(transformer["ln_f"](x))

    def forward(self, idx: torch.Tensor | tuple | list, targets: torch.Tensor | None = None,
                return_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The GPT's call convention: logits, the loss with ``targets``, ``(loss, logits)`` with both."""
        if isinstance(idx, (tuple, list)):
            idx, targets = (idx[0], None) if len(idx) == 1 else (idx[0], idx[1])
        if idx.shape[1] > self.config.block_size:
            raise UserError(f"sequence length {idx.shape[1]} exceeds model.block_size={self.config.block_size}")
        logits = self._logits(idx)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return (loss, logits) if return_logits else loss

    # ---------------------------------------------------------------------------------------- generate
    def new_cache(self, batch: int, device: torch.device) -> KVCache:
        attn = self.gpt.transformer["h"][0].attn
        dtype = self.gpt.transformer["wte"].weight.dtype
        return KVCache.allocate(self.config.n_layer, batch, attn.n_head, self.capacity, attn.head_size, dtype, device)

    def check_room(self, prompt: int, new_tokens: int) -> None:
        """The cache must hold the prompt and every generated token but the last (which is never fed back)."""
        room = self.capacity - prompt + 1
        where = (f"the fused path holds {self.capacity} positions (min(max_out_tokens, block_size="
                 f"{self.config.block_size}))")
        if room < self.min_out_tokens:
            raise UserError(Problem("init_inference.min_out_tokens", f"a {prompt}-token prompt leaves room for "
                                    f"{max(room, 0)} new tokens, fewer than min_out_tokens={self.min_out_tokens}; "
                                    f"{where}", "shorten the prompt or raise max_out_tokens"))
        if new_tokens > room:
            raise UserError(Problem("max_new_tokens", f"{prompt} prompt tokens + {new_tokens} new tokens exceed what "
                                    f"{where} allows ({max(room, 0)} new tokens)",
                                    "ask for fewer tokens, or raise max_out_tokens"))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``GPT.generate`` with a KV cache: the prompt once, then one token per forward."""
        batch, prompt = idx.shape
        if max_new_tokens <= 0:
            return idx
        self.check_room(prompt, max_new_tokens)
        cache = self.new_cache(batch, idx.device)
        logits = self._logits(idx, cache, 0)[:, -1, :]
        tokens = [idx]
        for step in range(max_new_tokens):
            next_token = sample_next_token(logits, temperature, top_k, generator)
            tokens.append(next_token)
            if step + 1 < max_new_tokens:
                logits = self._logits(next_token, cache, prompt + step)[:, -1, :]
        return torch.cat(tokens, dim=1)
