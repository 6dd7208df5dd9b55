"""AutoEP's router: token-choice top-k over a linear gate, with optional group-limited routing (DeepSeek's)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def count_tokens_per_expert(selected_experts_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """An int32 histogram of the routed slots per expert (its length known up front: no host sync, unlike
    ``torch.bincount``)."""
    flat = selected_experts_indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts by gate score.

    Scores are ``softmax`` or ``sigmoid`` of the gate's logits, in fp32. The choice may add a load-balancing
    ``expert_bias`` and a trained ``e_score_correction_bias`` (DeepSeek-V3), and, with ``num_expert_groups``, is
    limited to the best ``num_limited_groups`` groups (scored by their best expert, ``"max"``, or the sum of
    their best two, ``"top2_sum"``); the weights are the unbiased scores of the chosen experts, normalised to
    sum to 1 when ``route_norm``, then times ``route_scale``. ``forward(x)`` returns ``(top_scores [T, k],
    selected_experts [T, k], num_tokens_per_expert [E])``.
    """

    def __init__(self, dim: int, num_experts: int, num_expert_groups: int | None, num_limited_groups: int | None,
                 top_k: int, score_func: str, route_norm: bool, route_scale: float, gate_bias: bool,
                 group_score_func: str = "top2_sum"):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.group_score_func = group_score_func
        self.e_score_correction_bias = None  # a Parameter when the source router has one

    def _get_node_limited_routing_scores(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """``scores_for_choice`` with the experts outside each token's best groups at -inf."""
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if limited is None:
            raise ValueError("num_limited_groups must be set when num_expert_groups is set")
        if limited < 1:
            raise ValueError(f"num_limited_groups must be >= 1, got {limited}")
        if self.num_experts % groups:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by num_expert_groups ({groups})")
        per_group = self.num_experts // groups
        grouped = scores_for_choice.view(-1, groups, per_group)
        if self.group_score_func == "max":
            group_scores = grouped.max(dim=-1).values
        elif self.group_score_func == "top2_sum":
            if per_group < 2:
                raise ValueError(f"experts_per_group ({per_group}) must be >= 2")
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            raise NotImplementedError(f"Unknown group score function: {self.group_score_func}")
        chosen = torch.topk(group_scores, k=limited, dim=-1, sorted=False).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, chosen, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> tuple:
        logits = self.gate(x).to(torch.float32)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        elif self.score_func == "softmax":
            scores = F.softmax(logits, dim=1)
        else:
            raise NotImplementedError(f"Unknown score function: {self.score_func}")
        for_choice = scores if expert_bias is None else scores + expert_bias
        if self.e_score_correction_bias is not None:
            for_choice = for_choice + self.e_score_correction_bias.unsqueeze(0)
        if self.num_expert_groups is not None:
            for_choice = self._get_node_limited_routing_scores(for_choice)
        selected = torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(dim=1, index=selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        return top_scores, selected, count_tokens_per_expert(selected, self.num_experts)
