"""``deepspeed.moe.experts.Experts``: this rank's experts of one MoE layer.

Each local expert is a deep copy of the ``expert`` module handed to :class:`dsrun.moe.layer.MoE` (so all start
equal, as in DeepSpeed, unless the model initialises them; see :meth:`Experts.reset_parameters`). Every
parameter is marked as DeepSpeed marks expert parameters: ``allreduce = False`` (its gradient is not averaged
over the whole data-parallel group) and ``group_name = "ep_size_E"`` (the expert-data-parallel group it is
replicated over). The engine reads those marks (:meth:`dsrun.comm.ProcessGroups.group_of_param`).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch


def mark_expert_param(param: torch.nn.Parameter, group_name: str) -> None:
    param.allreduce = False
    param.group_name = group_name


class Experts(torch.nn.Module):
    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                mark_expert_param(param, expert_group_name or "ep_size_1")

    def run(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``index`` on ``rows`` (any leading shape, last dim the model's)."""
        out = self.deepspeed_experts[index](rows)
        return out[0] if isinstance(out, tuple) else out

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` (ep, num_local_experts, C, M): local expert j gets ``inputs[:, j]``."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        return torch.cat([self.run(j, chunk) for j, chunk in enumerate(chunks)], dim=1)

    @torch.no_grad()
    def reset_parameters(self, first_global_id: int, init: Callable[[torch.nn.Module, int], None]) -> None:
        """Call ``init(expert, global_id)`` on each local expert: a model that draws each expert's weights from
        its global id gets the same experts whatever the expert-parallel size."""
        for j, module in enumerate(self.deepspeed_experts):
            init(module, first_global_id + j)
