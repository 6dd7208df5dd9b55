"""``SparseAttentionUtils``: fit sparse attention into an existing model (DeepSpeed's static helpers).

Models are recognised by their attributes: a Hugging Face-style BERT (``model.bert``) or RoBERTa
(``model.roberta``), whose layers have ``attention.self`` with ``query``/``key``/``value``, and dsrun's
GPT (``model.transformer.h``, blocks with ``attn``; positions in ``transformer.wpe``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.ops.sparse_attention.bert_sparse_self_attention import BertShape, BertSparseSelfAttention
from dsrun.ops.sparse_attention.sparse_self_attention import CausalSparseSelfAttention
from dsrun.ops.sparse_attention.sparsity_config import SparsityConfig


class _Tokenizer(Protocol):
    """What :meth:`SparseAttentionUtils.update_tokenizer_model_max_length` sets on a Hugging Face tokenizer."""

    model_max_length: int
    init_kwargs: dict[str, Any]


_TokenizerT = TypeVar("_TokenizerT", bound=_Tokenizer)

ROBERTA_RESERVED_POSITIONS = 2  # RoBERTa's positions 0 and 1 are reserved (padding offset)


def _is_dsrun_gpt(model: nn.Module) -> bool:
    transformer = getattr(model, "transformer", None)
    return isinstance(transformer, nn.ModuleDict) and "h" in transformer and "wte" in transformer


def _tile_rows(weight: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """``weight[first:]`` repeated until it has ``rows`` rows (the rows before ``first`` kept in front)."""
    body = weight[first:]
    repeats = -(-rows // body.shape[0])
    return torch.cat([weight[:first], body.repeat(repeats, 1)[:rows]])


def _replace_embedding(embedding: nn.Embedding, weight: torch.Tensor) -> None:
    embedding.weight = nn.Parameter(weight.detach().clone(), requires_grad=embedding.weight.requires_grad)
    embedding.num_embeddings = weight.shape[0]


class SparseAttentionUtils:
    """Helpers for adapting a pretrained model to sparse self-attention."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Grow the learned position table to ``max_position`` positions by repeating the trained rows
        (DeepSpeed repeats whole copies only, leaving the table short when ``max_position`` is not a
        multiple of the old length; here the last copy is cut, so the table has exactly ``max_position``)."""
        if hasattr(model, "bert"):
            embedding = model.bert.embeddings.position_embeddings
            if max_position <= embedding.weight.shape[0]:
                raise ValueError(f"max_position {max_position} must exceed the current {embedding.weight.shape[0]}")
            _replace_embedding(embedding, _tile_rows(embedding.weight, 0, max_position))
            model.config.max_position_embeddings = max_position
        elif hasattr(model, "roberta"):
            embedding = model.roberta.embeddings.position_embeddings
            reserved = ROBERTA_RESERVED_POSITIONS
            if max_position <= embedding.weight.shape[0] - reserved:
                raise ValueError(f"max_position {max_position} must exceed the current "
                                 f"{embedding.weight.shape[0] - reserved}")
            _replace_embedding(embedding, _tile_rows(embedding.weight, reserved, max_position))
            model.config.max_position_embeddings = max_position + reserved
        elif _is_dsrun_gpt(model):
            if "wpe" not in model.transformer:
                raise ValueError("this GPT has rotary positions: there is no position table to extend")
            embedding = model.transformer["wpe"]
            if max_position <= embedding.weight.shape[0]:
                raise ValueError(f"max_position {max_position} must exceed model.block_size "
                                 f"{embedding.weight.shape[0]}")
            _replace_embedding(embedding, _tile_rows(embedding.weight, 0, max_position))
            model.config = dataclasses.replace(model.config, block_size=max_position)
        else:
            raise ValueError("extend_position_embedding supports BERT (model.bert), RoBERTa (model.roberta) and "
                             "dsrun's GPT (model.transformer.wpe)")
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: _TokenizerT, max_position: int) -> _TokenizerT:
        """Set a Hugging Face tokenizer's ``model_max_length`` (and its ``init_kwargs``) to ``max_position``."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(model: nn.Module, max_position: int,
                                                                 sparsity_config: SparsityConfig) -> nn.Module:
        """Swap every self-attention of a BERT, RoBERTa or dsrun GPT for sparse attention of ``max_position``
        tokens, keeping the trained projections (for the GPT: its ``c_attn``/``c_proj``; attention stays causal)."""
        if hasattr(model, "bert"):
            model.config.max_position_embeddings = max_position
            SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
                model.config, model.bert.encoder.layer, sparsity_config)
        elif hasattr(model, "roberta"):
            model.config.max_position_embeddings = max_position + ROBERTA_RESERVED_POSITIONS
            SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
                model.config, model.roberta.encoder.layer, sparsity_config)
        elif _is_dsrun_gpt(model):
            for block in model.transformer["h"]:
                block.attn.sparse = CausalSparseSelfAttention(sparsity_config, max_position)
        else:
            raise ValueError("replace_model_self_attention_with_sparse_self_attention supports BERT (model.bert), "
                             "RoBERTa (model.roberta) and dsrun's GPT (model.transformer.h)")
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
            config: BertShape, layers: Iterable[nn.Module], sparsity_config: SparsityConfig) -> Iterable[nn.Module]:
        """Give each BERT layer's ``attention.self`` a :class:`BertSparseSelfAttention` with its own
        query/key/value projections."""
        for layer in layers:
            sparse = BertSparseSelfAttention(config, sparsity_config)
            old = layer.attention.self
            sparse.query, sparse.key, sparse.value = old.query, old.key, old.value
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                          token_type_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int,
                          model_embeddings: nn.Module | None) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pad the sequence dimension to a multiple of ``block_size``; returns ``(pad_len, input_ids,
        attention_mask, token_type_ids, position_ids, inputs_embeds)``. Padding tokens are
        ``pad_token_id`` (their embeddings from ``model_embeddings`` when ``inputs_embeds`` is given), the
        attention mask is 0 over them, token types 0. Undo with :meth:`unpad_sequence_output`."""
        batch, seq = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = -seq % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            if model_embeddings is None:
                raise ValueError("padding inputs_embeds needs model_embeddings to embed the pad tokens")
            pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)

        def pad(t: torch.Tensor | None, value: float) -> torch.Tensor | None:
            return None if t is None else F.pad(t, (0, pad_len), value=value)

        return (pad_len, pad(input_ids, pad_token_id), pad(attention_mask, 0), pad(token_type_ids, 0),
                pad(position_ids, pad_token_id), inputs_embeds)

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Cut the ``pad_len`` padding positions added by :meth:`pad_to_block_size` from ``[B, L, ...]``."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
