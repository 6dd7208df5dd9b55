"""Counting a model: parameters (shared ones once), the largest layer, and analytic FLOPs.

These work on any ``nn.Module``, including one built on the meta device, so the memory estimator can size a
model that does not fit in memory. Shared parameters are recognised by object identity, not by
``data_ptr()``: every meta tensor reports the same null pointer.
"""
from __future__ import annotations

from typing import Iterator

from torch import nn

from dsrun.models.config import GPTConfig
from dsrun.profiling.mfu import train_flops_per_token


def _unique_parameters(module: nn.Module, recurse: bool = True) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for param in module.parameters(recurse=recurse):
        if id(param) not in seen:
            seen.add(id(param))
            yield param


def num_parameters(model: nn.Module, exclude_embeddings: bool = False, trainable_only: bool = False) -> int:
    """Number of parameters, each shared (tied) parameter counted once.

    ``exclude_embeddings`` leaves out the weights of every ``nn.Embedding`` (token and position tables),
    including where such a weight is tied to an output head: the usual "non-embedding" count.
    """
    excluded: set[int] = set()
    if exclude_embeddings:
        excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in _unique_parameters(model)
               if id(p) not in excluded and (p.requires_grad or not trainable_only))


def largest_layer_params(model: nn.Module) -> int:
    """The most parameters any single module holds directly (not counting its children).

    This is DeepSpeed's ``largest_layer_params`` for the ZeRO-3 estimator: the biggest set of parameters
    gathered at once. For a GPT it is usually the token embedding (``vocab_size x n_embd``).
    """
    return max((sum(p.numel() for p in _unique_parameters(m, recurse=False)) for m in model.modules()),
               default=0)


def _config_of(model_or_config: GPTConfig | nn.Module) -> GPTConfig:
    if isinstance(model_or_config, GPTConfig):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if not isinstance(config, GPTConfig):
        raise TypeError("analytic FLOPs need a GPTConfig or a dsrun GPT model; "
                        "measure other models with the flops profiler")
    return config


def matmul_parameters(model_or_config: GPTConfig | nn.Module) -> int:
    """The weights that multiply activations, ``12·n_layer·d² + vocab·d``: every block's QKV, output,
    and two MLP projections, and the output head (tied to the token embedding or not, it multiplies once);
    not the embedding lookups, LayerNorms or biases. PaLM's ``N`` in ``6·N`` FLOPs per token."""
    config = _config_of(model_or_config)
    return 12 * config.n_layer * config.n_embd ** 2 + config.vocab_size * config.n_embd


def forward_flops(model_or_config: GPTConfig | nn.Module, batch_size: int, seq_len: int) -> int:
    """Analytic floating-point operations of one forward pass over ``batch_size x seq_len`` tokens.

    ``2 · N · tokens`` for the matrix multiplies, where ``N = 12·n_layer·d² + vocab·d`` counts the weights
    that multiply activations (every block's linears and the output head; not the embedding lookups,
    LayerNorms or biases), plus the attention scores and weighted sum: ``2 · 2 · n_layer · seq_len · d``
    per token (``QKᵀ`` and ``AV``, each ``seq_len·d`` multiply-adds per query). The attention term counts
    the full ``T x T`` square, as most published MFU figures do, although a causal kernel skips half.
    """
    config = _config_of(model_or_config)
    tokens = batch_size * seq_len
    d = config.n_embd
    matmul_weights = matmul_parameters(config)
    attention = 4 * config.n_layer * seq_len * d
    return 2 * matmul_weights * tokens + attention * tokens


def recompute_flops(model_or_config: GPTConfig | nn.Module, batch_size: int, seq_len: int,
                    activation_checkpointing: object = None) -> int:
    """Forward FLOPs that activation checkpointing runs again in backward (the terms of
    :func:`forward_flops`): one block's ``2·12·d² + 4·seq_len·d`` per token for each checkpointed block;
    ``selective`` recomputes only the QKV projection (``2·3·d²`` per token) of each block, the attention
    kernel's and the other projections' outputs being kept. ``None`` reads the mode from the config."""
    from dsrun.activation_checkpointing.modes import CheckpointMode

    config = _config_of(model_or_config)
    mode = CheckpointMode.parse(config.activation_checkpointing if activation_checkpointing is None
                                else activation_checkpointing)
    tokens, d = batch_size * seq_len, config.n_embd
    per_block = 2 * 3 * d * d if mode.kind == "selective" else 2 * 12 * d * d + 4 * seq_len * d
    return mode.checkpointed_blocks(config.n_layer) * per_block * tokens


def train_step_flops(model_or_config: GPTConfig | nn.Module, batch_size: int, seq_len: int,
                     activation_checkpointing: object = None) -> int:
    """Forward + backward FLOPs: 3x the forward (backward costs twice the forward) plus what activation
    checkpointing recomputes (:func:`recompute_flops`; ``activation_checkpointing`` is a mode, a bool, or
    None for the config's)."""
    return 3 * forward_flops(model_or_config, batch_size, seq_len) + recompute_flops(
        model_or_config, batch_size, seq_len, activation_checkpointing)


def model_step_flops(model_or_config: GPTConfig | nn.Module, batch_size: int, seq_len: int) -> int:
    """The model FLOPs of training ``batch_size x seq_len`` tokens, the numerator of MFU: PaLM's
    ``6·N + 12·L·d·T`` per token (:func:`dsrun.profiling.mfu.train_flops_per_token`, ``N`` =
    :func:`matmul_parameters`), which is ``3 x`` :func:`forward_flops`; activation-checkpoint recompute is
    not counted (:func:`train_step_flops` counts it: the hardware's FLOPs)."""
    config = _config_of(model_or_config)
    per_token = train_flops_per_token(matmul_parameters(config), config.n_layer, config.n_embd, seq_len)
    return batch_size * seq_len * per_token
