"""The built-in GPT as a sequence of layers, for pipeline parallelism.

:class:`~dsrun.models.gpt.GPT` computes ``head(ln_f(blocks(drop(wte(idx) + wpe(pos)))))``; here the same
computation is a list of layers a ``PipelineModule`` can cut into stages (:func:`pipeline_layers`): the token
embedding, the positions (added, then dropout), the blocks, the final LayerNorm and the output head. With
tied embeddings the head is the token embedding's table used again, so both ends name it by one key and the
pipeline keeps the two copies identical. Every layer is initialised as the GPT initialises it
(:func:`~dsrun.models.gpt.gpt2_init`); :mod:`dsrun.workloads.pipeline` turns the list into layer specs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.models.config import GPTConfig
from dsrun.models.gpt import IGNORE_INDEX, gpt2_init
from dsrun.models.layers import LAYER_NORM_EPS, Block
from dsrun.utils.errors import UserError

TIE_KEY = "embed"


class TokenEmbedding(nn.Embedding):
    """``idx [B, T]`` (int64) -> ``[B, T, n_embd]``; the tied output head reads its ``weight``."""

    def __init__(self, config: GPTConfig):
        super().__init__(config.vocab_size, config.n_embd)
        gpt2_init(self, config.n_layer)


class Positions(nn.Module):
    """Adds the learned position table (none with rotary positions), then the embedding dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.block_size = config.block_size
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.positions == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        gpt2_init(self, config.n_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        if seq > self.block_size:
            raise UserError(f"sequence length {seq} exceeds model.block_size={self.block_size} "
                            "(lower data.seq_len or raise model.block_size)")
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(seq, device=x.device))
        return self.drop(x)


class GPTBlock(Block):
    def __init__(self, config: GPTConfig):
        super().__init__(config)
        gpt2_init(self, config.n_layer)


class FinalNorm(nn.LayerNorm):
    def __init__(self, config: GPTConfig):
        super().__init__(config.n_embd, eps=LAYER_NORM_EPS, bias=config.bias)


class Head(nn.Linear):
    """The untied output head."""

    def __init__(self, config: GPTConfig):
        super().__init__(config.n_embd, config.vocab_size, bias=False)
        gpt2_init(self, config.n_layer)


def tied_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head of a tied GPT: the token table as the projection to the vocabulary."""
    return F.linear(x, embedding.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss: mean cross-entropy in fp32, targets ``-100`` ignored."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class PipeLayer:
    """One layer of the list: built as ``typename(config)``; ``tie_key`` shares it with the other layers of
    that key, used through ``forward_fn(module, x)`` when given."""

    typename: type
    tie_key: str | None = None
    forward_fn: Callable | None = None


def pipeline_layers(config: GPTConfig) -> list[PipeLayer]:
    """The GPT as ``n_layer + 4`` layers: embedding, positions, blocks, final norm, head."""
    tie = TIE_KEY if config.tie_embeddings else None
    head = PipeLayer(TokenEmbedding, tie, tied_head) if tie else PipeLayer(Head)
    return ([PipeLayer(TokenEmbedding, tie), PipeLayer(Positions)] + [PipeLayer(GPTBlock)] * config.n_layer
            + [PipeLayer(FinalNorm), head])



def dense_names(config: GPTConfig) -> dict[str, str]:
    """``{layer name: GPT name}``: each parameter and buffer of :func:`pipeline_layers`, named by layer index as
    a dense ``nn.Sequential`` of them would (a tied head at the embedding's index), mapped to the name
    :class:`~dsrun.models.gpt.GPT` gives it (universal checkpoints use the GPT's names, so the GPT and its
    pipelined form load each other's: dsrun/checkpoint/pipeline_state.py)."""
    with torch.device("meta"):
        block_keys = list(Block(config).state_dict())
    names = {"0.weight": "transformer.wte.weight"}
    if config.positions == "learned":
        names["1.wpe.weight"] = "transformer.wpe.weight"
    for i in range(config.n_layer):
        names.update({f"{2 + i}.{key}": f"transformer.h.{i}.{key}" for key in block_keys})
    final = 2 + config.n_layer
    names.update({f"{final}.{key}": f"transformer.ln_f.{key}" for key in ("weight", "bias")[:2 if config.bias else 1]})
    if not config.tie_embeddings:
        names[f"{final + 1}.weight"] = "lm_head.weight"
    return names
