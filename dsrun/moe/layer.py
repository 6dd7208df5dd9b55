"""``deepspeed.moe.layer.MoE``: a Mixture-of-Experts layer, ``output, l_aux, exp_counts = moe(hidden_states)``.

``num_experts`` copies of ``expert`` are spread over ``ep_size`` ranks (``num_experts / ep_size`` on each);
tokens reach them through all-to-alls over the expert-parallel group (:mod:`.sharded_moe`). With
``use_residual`` (Residual MoE, the "R" of PR-MoE) the layer also runs ``expert`` itself as a dense MLP on every
token and mixes the two outputs with a learned per-token softmax coefficient. ``l_aux`` is the load-balancing
loss: add ``coef * l_aux`` to your loss yourself, as with DeepSpeed.

Expert-parallel groups are created when the engine is built (``dsrun.initialize`` calls
:meth:`MoE.set_deepspeed_parallelism`), or at the first forward without an engine. Beyond DeepSpeed:
``dropless=True`` routes every token without capacity (sorted by expert, variable all-to-all), and the gate
clamps capacity to the number of tokens.
"""
from __future__ import annotations

import torch

from dsrun.comm.groups import ProcessGroups, current_groups, set_current_groups
from dsrun.utils.errors import ConfigError, Problem

from . import groups
from .experts import Experts
from .sharded_moe import MOELayer, TopKGate


class MoE(torch.nn.Module):
    """Initialize an MoE layer (DeepSpeed's signature; ``dropless`` is keyword-only and dsrun's own)."""

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, dropless: bool = False):
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ConfigError(Problem("MoE num_experts", f"{num_experts} must be divisible by ep_size={ep_size}",
                                      "use a multiple of ep_size, or an ep_size that divides the number of experts"))
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE enable_expert_tensor_parallelism=True: dsrun has no tensor-parallel experts; "
                             "leave it False (experts are data-parallel within their expert-data group)")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = int(ep_size)
        self.num_experts = int(num_experts)
        self.num_local_experts = self.num_experts // self.ep_size
        self.expert_group_name = groups.expert_group_name(self.ep_size)
        self.hidden_size = hidden_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, self.ep_size, self.num_local_experts,
                                      use_tutel=use_tutel, dropless=dropless)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)
        self._parallel_set = self.ep_size == 1

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (collectively) and attach this layer's expert-parallel group."""
        self._create_process_groups(use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        groups._create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_)
        if self.ep_size > 1:
            self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))
        self._parallel_set = True

    @property
    def ep_rank(self) -> int:
        """This rank's position in its expert-parallel group (0 when ``ep_size`` is 1)."""
        if self.ep_size == 1:
            return 0
        if not self._parallel_set:
            self._create_process_groups()
        return groups._get_expert_parallel_rank(self.expert_group_name)

    def global_expert_ids(self) -> list[int]:
        """The global ids of this rank's experts, in local order."""
        first = self.ep_rank * self.num_local_experts
        return list(range(first, first + self.num_local_experts))

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(output, l_aux, exp_counts)``."""
        if not self._parallel_set:
            self._create_process_groups()
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def moe_layers(module: torch.nn.Module) -> list[MoE]:
    """The MoE layers of ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def attach_process_groups(module: torch.nn.Module, process_groups: ProcessGroups, data_before_expert: bool = False) -> list[MoE]:
    """Give every MoE layer of ``module`` its expert group from the engine's process groups, which become the
    run's groups if they are not yet (collective; every rank calls it with the same model).
    ``data_before_expert``: the config's ``use_data_before_expert_parallelism``. Returns the layers."""
    layers = moe_layers(module)
    if layers:
        process_groups.set_expert_layout(data_before_expert)
        if current_groups() is not process_groups:
            set_current_groups(process_groups, data_before_expert)
        for layer in layers:
            layer.set_deepspeed_parallelism(data_before_expert)
    return layers


def split_experts(layer: MoE, ep_size: int) -> list[int]:
    """Spread a whole layer's experts (built with ``ep_size=1``) over expert-parallel groups of ``ep_size``
    ranks: create the groups (collective), keep this rank's ``num_experts / ep_size`` experts and drop the
    others (as automatic tensor parallelism keeps a rank's slices). Returns the kept experts' global ids."""
    if layer.ep_size != 1:
        raise ValueError(f"split_experts: the layer already spreads its experts over {layer.ep_size} ranks")
    if ep_size < 1 or layer.num_experts % ep_size:
        raise ValueError(f"split_experts: ep_size={ep_size} does not divide num_experts={layer.num_experts}")
    if ep_size == 1:
        return list(range(layer.num_experts))
    name = groups.expert_group_name(ep_size)
    local = layer.num_experts // ep_size
    layer.ep_size, layer.num_local_experts, layer.expert_group_name = ep_size, local, name
    moe = layer.deepspeed_moe
    moe.ep_size, moe.num_local_experts, moe.ep_group_name = ep_size, local, name
    layer._create_process_groups()
    keep = layer.global_expert_ids()
    experts = moe.experts
    experts.deepspeed_experts = torch.nn.ModuleList([experts.deepspeed_experts[g] for g in keep])
    experts.num_local_experts = local
    for module in experts.deepspeed_experts:
        for param in module.parameters():
            param.group_name = name
    return keep
