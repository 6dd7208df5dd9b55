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

import functools
import math
from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsrun import comm
from dsrun.models.config import GPTConfig, GPTOption
from dsrun.models.layers import LAYER_NORM_EPS, Block
from dsrun.activation_checkpointing.modes import BlockCheckpointing, CheckpointFn
from dsrun.sequence import groups as sequence_groups
from dsrun.sequence.batch import sequence_slice
from dsrun.utils.errors import UserError

IGNORE_INDEX = -100
INIT_STD = 0.02


def _embedding(num: int, dim: int) -> nn.Embedding:
    # Passing the (uninitialised) weight skips nn.Embedding's own init, which reset_parameters redoes anyway
    # and which on the meta device costs a one-off second importing torch._dynamo.
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def gpt2_init(model: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation of ``model``'s modules: N(0, 0.02) weights, zero biases, and the two residual
    output projections of each block scaled by ``1/sqrt(2·n_layer)`` so the residual stream's variance does
    not grow with depth. Parameters on the meta device are left alone."""
    residual_std = INIT_STD / math.sqrt(2 * n_layer)
    for name, module in model.named_modules():
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


def pld_keep_probabilities(theta: float, num_layers: int) -> list[float]:
    """The PLD paper's keep probability of each block at global keep probability ``theta``:
    ``1 - (i/L)(1 - theta)`` for block ``i = 1..L``."""
    return [1.0 - (i / num_layers) * (1.0 - theta) for i in range(1, num_layers + 1)]


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


def sequence_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, shards: int) -> torch.Tensor:
    """The loss of one rank holding a slice of each sequence (Ulysses), for an engine that averages gradients
    over every data x sequence rank: its value is the whole sequences' mean cross-entropy (the same on every
    rank of the group), its gradient that of ``shards · (this slice's summed loss) / (the group's target
    count)``, so the average over the group's ranks is exactly the gradient of the full mean, ignored targets
    included."""
    flat = targets.reshape(-1)
    summed = F.cross_entropy(logits.view(-1, logits.size(-1)), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    totals = torch.stack([summed.detach(), (flat != IGNORE_INDEX).sum().to(summed.dtype)])
    comm.all_reduce(totals, group=sequence_groups._get_sequence_parallel_group())
    share = summed * (shards / totals[1].item())  # a number, not a tensor autograd would keep for backward
    return share + (totals[0] / totals[1] - share).detach()


class GPT(nn.Module):
    """GPT decoder language model; see the module docstring for the call convention."""

    def __init__(self, config: GPTConfig | dict[str, Any] | None = None, **kwargs: GPTOption):
        super().__init__()
        if isinstance(config, GPTConfig):
            if kwargs:
                config = GPTConfig.from_kwargs({**config.to_dict(), **kwargs})
        else:
            config = GPTConfig.from_kwargs({**(config or {}), **kwargs})
        self.config = config  # config.pipeline_stages is for dsrun train, which builds a PipelineModule instead
        layers: dict[str, nn.Module] = {"wte": _embedding(config.vocab_size, config.n_embd)}
        if config.positions == "learned":
            layers["wpe"] = _embedding(config.block_size, config.n_embd)
        layers["drop"] = nn.Dropout(config.dropout)
        layers["h"] = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        layers["ln_f"] = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS, bias=config.bias)
        self.transformer = nn.ModuleDict(layers)
        if config.tie_embeddings:
            # Built on meta (no vocab x width allocation), then given the token table itself: one Parameter
            # object in two places, which optimisers, parameter counts and ZeRO see once.
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.transformer["wte"].weight
        else:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.activation_checkpointing = BlockCheckpointing(config.activation_checkpointing)
        self.reset_parameters()

    # ----------------------------------------------------------------------------------------- init
    def reset_parameters(self) -> None:
        """GPT-2 initialisation (:func:`gpt2_init`)."""
        gpt2_init(self, self.config.n_layer)

    def enable_activation_checkpointing(self, enabled: bool = True, checkpoint_fn: CheckpointFn | None = None,
                                        mode: str | None = None) -> None:
        """Recompute blocks in backward instead of keeping their activations.

        ``mode`` is ``full``, ``every_N`` or ``selective`` (default: the configured mode, else ``full``);
        ``enabled=False`` means ``none``. ``checkpoint_fn(block, hidden)`` defaults to dsrun's non-reentrant
        checkpoint (selective: ``dsrun.checkpointing.selective_checkpoint``); pass your own, e.g.
        ``dsrun.checkpointing.checkpoint`` for DeepSpeed's reentrant one.
        """
        current = self.activation_checkpointing.mode
        chosen = "none" if not enabled else mode or (str(current) if current.enabled else "full")
        self.activation_checkpointing = BlockCheckpointing(chosen, checkpoint_fn)
        self.config = replace(self.config, activation_checkpointing=chosen)

    # -------------------------------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor | None = None,
                return_logits: bool = False, curriculum_seqlen: int | None = None,
                progressive_layer_drop: bool = False, pld_theta: float | None = None,
                sequence_sharded: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, T, V]`` without targets; the mean loss with them; ``(loss, logits)`` when
        ``return_logits``. ``idx`` may also be the batch ``(inputs, targets)`` itself.

        Under Ulysses (``sequence_parallel``) the model takes this rank's slice of whole sequences; with
        ``sequence_sharded=True`` the inputs and targets already are that slice (``dsrun.sequence.shard_sequence``,
        as ``dsrun train`` feeds them), so the rank never holds the whole sequence's tokens.

        The engine's data-efficiency arguments (DeepSpeed's names): ``curriculum_seqlen`` keeps the first that
        many positions of inputs and targets (the legacy seqlen curriculum); ``progressive_layer_drop=True,
        pld_theta=θ`` skips blocks while training as the PLD paper prescribes (:meth:`_pld_plan`)."""
        if isinstance(idx, (tuple, list)):
            if targets is not None or len(idx) not in (1, 2):
                raise TypeError("pass either a batch (inputs, targets) or inputs and targets, not both")
            idx, targets = (idx[0], None) if len(idx) == 1 else (idx[0], idx[1])
        if curriculum_seqlen is not None and sequence_sharded:
            raise UserError("the seqlen curriculum truncates whole sequences: pass whole sequences to a "
                            "sequence-parallel GPT (sequence_sharded=False) when curriculum_seqlen is set")
        if curriculum_seqlen is not None and curriculum_seqlen < idx.size(1):  # data efficiency: seqlen curriculum
            idx = idx[:, :curriculum_seqlen]
            targets = targets[:, :curriculum_seqlen] if targets is not None else None
        batch, seq = idx.shape
        start, shards = 0, sequence_groups._get_sequence_parallel_world_size() if self.config.sequence_parallel else 1
        if sequence_sharded and shards > 1:  # Ulysses, given this rank's slice already
            start = sequence_groups._get_sequence_parallel_rank() * seq
            if seq * shards > self.config.block_size:
                raise UserError(f"sequence length {seq * shards} ({shards} slices of {seq}) exceeds model.block_size="
                                f"{self.config.block_size} (lower data.seq_len or raise model.block_size)")
        elif seq > self.config.block_size:
            raise UserError(f"sequence length {seq} exceeds model.block_size={self.config.block_size} "
                            "(lower data.seq_len or raise model.block_size)")
        elif shards > 1:  # Ulysses: this rank keeps its slice of every sequence (docs/sequence_parallel.md)
            start, seq = sequence_slice(seq)  # views: the caller holds the whole batch anyway
            idx = idx[:, start:start + seq]
            targets = targets[:, start:start + seq] if targets is not None else None
        x = self.transformer["wte"](idx)
        if "wpe" in self.transformer:
            x = x + self.transformer["wpe"](torch.arange(start, start + seq, device=idx.device))
        x = self.transformer["drop"](x)
        plan = self._pld_plan(pld_theta) if progressive_layer_drop and self.training else None
        for index, block in enumerate(self.transformer["h"]):
            if plan is not None:  # data efficiency: progressive layer drop
                if plan[index] == 0.0:
                    continue
                block = functools.partial(block, residual_scale=plan[index]) if plan[index] != 1.0 else block
            x = self.activation_checkpointing(index, block, x) if self.training else block(x)
        logits = self.lm_head(self.transformer["ln_f"](x))
        if targets is None:
            return logits
        # The loss in fp32 even under bf16/fp16: a softmax over 50k entries loses too much in half precision
        # (a float64 model keeps float64).
        logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if shards > 1:
            loss = sequence_parallel_loss(logits32, targets, shards)
        else:
            loss = F.cross_entropy(logits32.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return (loss, logits) if return_logits else loss

    def _pld_plan(self, pld_theta: float | None) -> list[float]:
        """Progressive layer drop for one forward: block ``i`` (1-based) of ``L`` runs with probability
        ``p_i = 1 - (i/L)(1 - θ)`` (the first blocks almost always, the last with probability θ) and its residual
        branches are then scaled by ``1/p_i``. Returns each block's scale, 0 for a skipped block; the draws
        come from torch's global generator (so checkpoints restore them)."""
        keep = pld_keep_probabilities(1.0 if pld_theta is None else float(pld_theta), self.config.n_layer)
        draws = torch.rand(len(keep)).tolist()
        return [1.0 / p if u < p else 0.0 for u, p in zip(draws, keep)]

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
