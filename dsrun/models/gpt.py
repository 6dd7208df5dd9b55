"""A readable GPT: pre-norm decoder blocks, learned or rotary positions, tied embeddings.

Built from keyword arguments so Hydra can instantiate it straight from ``conf/model/*.yaml``::

    model = GPT(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
    model = hydra.utils.instantiate(cfg.model)          # _target_: dsrun.models.gpt.GPT

How a batch maps to the call: the data layer yields ``(inputs, targets)``, two int64 tensors ``[B, T]``
where ``targets`` is ``inputs`` shifted left by one token. ``model(inputs, targets)`` returns the mean
cross-entropy loss (a scalar tensor); ``model(inputs)`` returns logits ``[B, T, vocab_size]``. The model
also accepts the batch itself as its first argument, so ``loss = model(batch)``, ``model(*batch)`` and
an engine that calls ``engine(batch)`` or ``engine(*batch)`` all compute the loss. Target positions
equal to ``-100`` are ignored (``torch.nn.functional.cross_entropy``'s ``ignore_index``).

Building under ``with torch.device("meta"):`` allocates nothing; initialisation is skipped on meta
tensors, so a 13B model builds in milliseconds.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsrun.models.config import GPTConfig
from dsrun.models.layers import Block
from dsrun.utils.errors import UserError

IGNORE_INDEX = -100
INIT_STD = 0.02

CheckpointFn = Callable[..., torch.Tensor]


def _torch_checkpoint(function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    # Non-reentrant checkpointing works with inputs that do not require grad and with keyword args;
    # it restores the RNG state, so dropout masks match the first forward.
    return checkpoint(function, *args, use_reentrant=False)


def _embedding(num: int, dim: int) -> nn.Embedding:
    # Passing the (uninitialised) weight skips nn.Embedding's own init, which reset_parameters redoes anyway
    # and which on the meta device costs a one-off second importing torch._dynamo.
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token ``[B, 1]`` from the last position's logits ``[B, V]``: the argmax at temperature 0,
    else a draw from the softmax of ``logits / temperature`` over the ``top_k`` largest (all when None)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


class GPT(nn.Module):
    """GPT decoder language model; see the module docstring for the call convention."""

    def __init__(self, config: GPTConfig | dict[str, Any] | None = None, **kwargs: Any):
        super().__init__()
        if isinstance(config, GPTConfig):
            if kwargs:
                config = GPTConfig.from_kwargs({**config.to_dict(), **kwargs})
        else:
            config = GPTConfig.from_kwargs({**(config or {}), **kwargs})
        self.config = config
        layers: dict[str, nn.Module] = {"wte": _embedding(config.vocab_size, config.n_embd)}
        if config.positions == "learned":
            layers["wpe"] = _embedding(config.block_size, config.n_embd)
        layers["drop"] = nn.Dropout(config.dropout)
        layers["h"] = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        layers["ln_f"] = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.transformer = nn.ModuleDict(layers)
        if config.tie_embeddings:
            # Built on meta (no vocab x width allocation), then given the token table itself: one Parameter
            # object in two places, which optimisers, parameter counts and ZeRO see once.
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.transformer["wte"].weight
        else:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.checkpoint_fn: CheckpointFn | None = _torch_checkpoint if config.activation_checkpointing else None
        self.reset_parameters()

    # ----------------------------------------------------------------------------------------- init
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, and the two residual output projections
        of each block scaled by ``1/sqrt(2·n_layer)`` so the residual stream's variance does not grow
        with depth."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if any(p.is_meta for p in module.parameters(recurse=False)):
                continue  # nothing to initialise; and meta normal_ would import torch._dynamo (~1 s)
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith("c_proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def enable_activation_checkpointing(self, enabled: bool = True,
                                        checkpoint_fn: CheckpointFn | None = None) -> None:
        """Recompute each block in backward instead of keeping its activations.

        ``checkpoint_fn(block, hidden)`` defaults to ``torch.utils.checkpoint.checkpoint`` (non-reentrant);
        an engine may pass its own (for example ``dsrun.checkpointing.checkpoint``, which can partition or
        offload the saved inputs).
        """
        self.checkpoint_fn = (checkpoint_fn or _torch_checkpoint) if enabled else None

    # -------------------------------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor | None = None,
                return_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, T, V]`` without targets; the mean loss with them; ``(loss, logits)`` when
        ``return_logits``. ``idx`` may also be the batch ``(inputs, targets)`` itself."""
        if isinstance(idx, (tuple, list)):
            if targets is not None or len(idx) not in (1, 2):
                raise TypeError("pass either a batch (inputs, targets) or inputs and targets, not both")
            idx, targets = (idx[0], None) if len(idx) == 1 else (idx[0], idx[1])
        batch, seq = idx.shape
        if seq > self.config.block_size:
            raise UserError(f"sequence length {seq} exceeds model.block_size={self.config.block_size} "
                            "(lower data.seq_len or raise model.block_size)")
        x = self.transformer["wte"](idx)
        if "wpe" in self.transformer:
            x = x + self.transformer["wpe"](torch.arange(seq, device=idx.device))
        x = self.transformer["drop"](x)
        for block in self.transformer["h"]:
            if self.checkpoint_fn is not None and self.training and torch.is_grad_enabled():
                x = self.checkpoint_fn(block, x)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer["ln_f"](x))
        if targets is None:
            return logits
        # The loss in fp32 even under bf16/fp16: a softmax over 50k entries loses too much in half precision
        # (a float64 model keeps float64).
        logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits32.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return (loss, logits) if return_logits else loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` ``[B, T]`` (temperature 0 means greedy)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            next_token = sample_next_token(self(context)[:, -1, :], temperature, top_k, generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def extra_repr(self) -> str:
        c = self.config
        return (f"layers={c.n_layer}, heads={c.n_head}, width={c.n_embd}, vocab={c.vocab_size}, "
                f"block_size={c.block_size}, positions={c.positions}, tied={c.tie_embeddings}")
