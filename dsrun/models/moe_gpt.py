"""The built-in GPT with Mixture-of-Experts MLPs: ``model._target_: dsrun.models.moe_gpt.MoEGPT`` and ``model.moe``.

``moe`` options (recipe ``gpt_moe``):

====================  ==========================================================================
num_experts           experts per MoE layer: one number, or one per MoE layer (PR-MoE's pyramid)
k                     experts per token (top-k gating)
every                 an MoE MLP in every N-th block (1: all; 2: blocks 1, 3, 5 ...), dense MLPs between
ep_size               expert-parallel size (divides num_experts and the data-parallel size)
residual              Residual MoE: each MoE layer also runs a dense MLP, mixed by a learned coefficient
loss_coeff            weight of the summed load-balancing losses added to the training loss
capacity_factor, eval_capacity_factor, min_capacity, drop_tokens, use_rts, noisy_gate_policy, dropless
                      as :class:`dsrun.moe.layer.MoE`
====================  ==========================================================================

Each expert is initialised as the GPT's MLP is (N(0, 0.02), the output projection scaled by
``1/sqrt(2 n_layer)``) from a generator seeded by its layer and global id, so the model is the same whatever
the expert-parallel size. The forward adds ``loss_coeff * sum(l_aux)`` to the loss, as a DeepSpeed user does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from dsrun import comm
from dsrun.models.config import GPTOption
from dsrun.models.gpt import GPT, INIT_STD
from dsrun.models.layers import MLP
from dsrun.utils.errors import ConfigError, Problem

from dsrun.moe.layer import MoE


@dataclass(frozen=True)
class MoEOptions:
    num_experts: Any = 8
    k: int = 2
    every: int = 1
    ep_size: int = 1
    residual: bool = False
    loss_coeff: float = 0.01
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    noisy_gate_policy: Any = None
    dropless: bool = False

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "MoEOptions":
        known = [f.name for f in fields(cls)]
        unknown = [k for k in (values or {}) if k not in known]
        if unknown:
            raise ConfigError([Problem(f"model.moe.{k}", "is not an MoE option", "allowed: " + ", ".join(known))
                               for k in unknown])
        return cls(**dict(values or {}))

    def experts_per_layer(self, n_moe_layers: int) -> list[int]:
        counts = list(self.num_experts) if isinstance(self.num_experts, (list, tuple)) else \
            [int(self.num_experts)] * n_moe_layers
        if len(counts) != n_moe_layers:
            raise ConfigError(Problem("model.moe.num_experts", f"lists {len(counts)} counts for {n_moe_layers} "
                                      "MoE layers", "give one count per MoE layer, or a single number"))
        uneven = [int(c) for c in counts if self.ep_size >= 1 and int(c) % self.ep_size]
        if uneven:
            raise ConfigError(Problem("model.moe.num_experts", f"{uneven[0]} experts cannot be spread evenly over "
                                      f"model.moe.ep_size={self.ep_size} ranks", "use a multiple of ep_size, or an "
                                      "ep_size that divides the number of experts"))
        return [int(c) for c in counts]


class MoEMLP(nn.Module):
    """A block's MLP slot holding an MoE layer: returns the output, keeps ``l_aux`` for the model's loss."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe
        self.l_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, _ = self.moe(x)
        return out


class MoEGPT(GPT):
    """:class:`dsrun.models.gpt.GPT` with an MoE MLP in every ``moe.every``-th block."""

    def __init__(self, moe: Mapping[str, Any] | None = None, **kwargs: GPTOption):
        super().__init__(**kwargs)
        self.moe_options = MoEOptions.from_mapping(moe)
        opts, cfg = self.moe_options, self.config
        world = comm.get_world_size() if comm.is_initialized() else None
        if opts.ep_size < 1 or (world is not None and world % opts.ep_size):
            raise ConfigError(Problem("model.moe.ep_size", f"is {opts.ep_size}; it must divide the {world} "
                                      "data-parallel rank(s)", "set model.moe.ep_size=1, or launch a multiple of "
                                      f"{opts.ep_size} ranks (launcher.num_procs)"))
        every = max(1, int(opts.every))
        chosen = [i for i in range(cfg.n_layer) if (i + 1) % every == 0]
        counts = opts.experts_per_layer(len(chosen))
        for layer_id, (i, count) in enumerate(zip(chosen, counts)):
            block = self.transformer["h"][i]
            layer = MoE(cfg.n_embd, block.mlp, num_experts=count, ep_size=opts.ep_size, k=opts.k,
                        capacity_factor=opts.capacity_factor, eval_capacity_factor=opts.eval_capacity_factor,
                        min_capacity=opts.min_capacity, use_residual=opts.residual,
                        noisy_gate_policy=opts.noisy_gate_policy, drop_tokens=opts.drop_tokens, use_rts=opts.use_rts,
                        dropless=opts.dropless)
            if not layer.deepspeed_moe.gate.wg.weight.is_meta:  # (the estimator builds models on meta)
                residual_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
                first = layer.global_expert_ids()[0] if comm.is_initialized() else 0
                layer.deepspeed_moe.experts.reset_parameters(
                    first, lambda m, g, lid=layer_id: _init_expert(m, lid, g, residual_std))
                nn.init.normal_(layer.deepspeed_moe.gate.wg.weight, mean=0.0, std=INIT_STD)
            block.mlp = MoEMLP(layer)

    def moe_parameter_counts(self) -> tuple[int, int]:
        """(total parameters, parameters active for one token): an MoE layer activates k of its experts."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        inactive = 0
        for m in self.modules():
            if isinstance(m, MoE):
                per_expert = sum(p.numel() for p in m.deepspeed_moe.experts.deepspeed_experts[0].parameters())
                total += per_expert * (m.num_experts - m.num_local_experts)  # experts on other ranks
                inactive += per_expert * (m.num_experts - m.deepspeed_moe.gate.k)
        return total, total - inactive

    def forward(self, idx: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor | None = None,
                return_logits: bool = False, **kwargs: int | float | None) -> Any:
        moe_mlps = [m for m in self.modules() if isinstance(m, MoEMLP)]
        for m in moe_mlps:  # a block progressive layer drop skips adds no l_aux this step
            m.l_aux = None
        out = super().forward(idx, targets, return_logits, **kwargs)
        has_targets = targets is not None or (isinstance(idx, (tuple, list)) and len(idx) == 2)
        if not has_targets:
            return out
        aux = [m.l_aux for m in moe_mlps if m.l_aux is not None]
        extra = self.moe_options.loss_coeff * torch.stack(aux).sum() if aux else 0.0
        if return_logits:
            return out[0] + extra, out[1]
        return out + extra


@torch.no_grad()
def _init_expert(module: nn.Module, layer_id: int, global_id: int, residual_std: float) -> None:
    gen = torch.Generator(device="cpu").manual_seed(1_000_003 * (layer_id + 1) + global_id)
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            std = residual_std if name.endswith("c_proj") else INIT_STD
            sub.weight.copy_(torch.randn(sub.weight.shape, generator=gen) * std)
            if sub.bias is not None:
                sub.bias.zero_()


__all__ = ["MoEGPT", "MoEMLP", "MoEOptions", "MLP"]
