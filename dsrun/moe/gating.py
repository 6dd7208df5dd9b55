"""Top-k gating: which experts each token goes to, at which slot of their capacity, with what weight.

The gate is a linear map to one logit per expert, computed in fp32 (:class:`TopKGate`). From the softmax of
the logits:

* **k = 1** (Switch): each token's best expert (with ``noisy_gate_policy='RSample'`` the best of the logits
  plus Gumbel noise). Capacity ``ceil(S / E * capacity_factor)``; when more tokens want an expert, Random
  Token Selection (``use_rts``) keeps a uniformly random subset, else the first ones in token order. The
  combine weight is the token's gate probability.
* **k = 2** (GShard): the best expert and, among the others, the best of the logits plus Gumbel noise
  (``top2_2nd_expert_sampling``, else the second best). Capacity uses ``2 * capacity_factor``; first choices
  take their slots before second choices, each in token order. The two weights are renormalised to sum to 1.
* **k > 2**: the k best experts; capacity uses ``k * capacity_factor``; an over-full expert keeps the tokens
  with the highest gate probability (``drop_policy='probs'``) or the first ones in token order
  (``drop_policy='position'``); the kept weights are renormalised.

Capacity is clamped below by ``min_capacity``; as in DeepSpeed 0.19 it may exceed the number of tokens (the
buffers are that wide, padded with zeros: a tensor-parallel split of them needs that width), while the choice
of which tokens an over-full expert keeps selects at most the number of tokens. With ``drop_tokens=False`` the capacity
is the largest number of tokens any expert of the expert-parallel group receives (an all-reduce MAX that every
rank of the group makes, so every rank sizes its all-to-all buffers alike). ``Jitter`` multiplies the gate's
input by uniform noise in [1 - 1e-2, 1 + 1e-2] while training.

The load-balancing loss is ``l_aux = E * sum_i f_i * P_i`` with ``P_i`` the mean gate probability of expert i
and ``f_i`` the fraction of tokens whose first choice is i (all k choices for k > 2, divided by k), as DeepSpeed
computes it. ``exp_counts`` counts the tokens routed to each expert before any is dropped.

:func:`top1gating`, :func:`top2gating` and :func:`topkgating` return DeepSpeed's dense tuple
``(l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C], exp_counts)``, or with ``sparse_routes=True``
DeepSpeed 0.19's per-route tuple ``(l_aux, capacity, num_experts, indices [k, S], locations [k, S], gates [k, S],
exp_counts)`` (a dropped route has index -1, location and gate 0), which :func:`_route_slots`,
:func:`_sparse_encode` and :func:`_sparse_decode` (DeepSpeed's names) turn into the expert buffer and back. The
layer itself works on the sparse :class:`Routing` (k slots per token), which holds the same information.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsrun import comm
from dsrun.accelerator import get_accelerator

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
JITTER_EPS = 1e-2


@contextmanager
def timed_into(owner: object, attribute: str) -> Iterator[None]:
    """While ``owner.wall_clock_breakdown``, set ``owner.<attribute>`` to the block's time in ms, the device
    synchronised around it (DeepSpeed's MoE timers: ``gate_time``, ``time_moe``, the two all-to-alls)."""
    if not getattr(owner, "wall_clock_breakdown", False):
        yield
        return
    get_accelerator().synchronize()
    start = time.perf_counter()
    yield
    get_accelerator().synchronize()
    setattr(owner, attribute, (time.perf_counter() - start) * 1e3)


@dataclass
class Routing:
    """Where each of the k choices of each of S tokens goes."""

    experts: torch.Tensor  # (S, k) int64: the chosen global expert
    weights: torch.Tensor  # (S, k) fp32: combine weight (0 where dropped); differentiable w.r.t. the logits
    locations: torch.Tensor  # (S, k) int64: slot in the expert's capacity buffer (meaningful where kept)
    kept: torch.Tensor  # (S, k) bool: the choice fits in the expert's capacity
    capacity: int
    l_aux: torch.Tensor
    exp_counts: torch.Tensor  # (E,) int64: tokens routed to each expert before dropping
    num_experts: int

    @property
    def dropped(self) -> int:
        """Choices that did not fit (tokens x k less kept)."""
        routed = int(self.exp_counts.sum())
        return routed - int(self.kept.sum())

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeed's ``(combine_weights, dispatch_mask)``, both (S, E, C)."""
        S, k = self.experts.shape
        combine = torch.zeros(S, self.num_experts, max(self.capacity, 0), dtype=self.weights.dtype,
                              device=self.weights.device)
        if self.capacity > 0:
            rows = torch.arange(S, device=self.experts.device).unsqueeze(1).expand(S, k)
            keep = self.kept
            combine = combine.index_put((rows[keep], self.experts[keep], self.locations[keep]),
                                        self.weights[keep], accumulate=True)
        return combine, combine.bool()


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """``ceil(num_tokens / num_experts * capacity_factor)`` (in DeepSpeed's order of operations, so the float
    rounds alike), at least ``min_capacity``."""
    return max(0, math.ceil((num_tokens / num_experts) * float(capacity_factor)), int(min_capacity))


def multiplicative_jitter(x: torch.Tensor, device: torch.device | str | None = None,
                          epsilon: float = JITTER_EPS) -> torch.Tensor:
    """``x`` times uniform noise in [1 - epsilon, 1 + epsilon] (the Switch Transformer's jitter)."""
    if epsilon == 0:
        return x
    noise = torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


def gumbel_rsample(shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
    """Standard Gumbel noise, ``-log(-log(U))``."""
    tiny = torch.finfo(torch.float32).tiny
    u = torch.rand(shape, device=device).clamp_(min=tiny, max=1.0 - torch.finfo(torch.float32).eps)
    return -torch.log(-torch.log(u))


class _World:
    """Stands for the default (whole-world) group where ``None`` would mean "no group"."""

    def __repr__(self) -> str:
        return "WORLD"


WORLD = _World()
# An expert-parallel group: a torch group, WORLD (the whole world) or None (this rank alone).
ExpertGroup = Union["dist.ProcessGroup", _World, None]


def as_comm_group(ep_group: ExpertGroup) -> comm.ProcessGroup:
    """The torch group for ``ep_group`` (``WORLD`` -> None, torch's default group)."""
    return None if ep_group is WORLD else ep_group


def _agreed_capacity(exp_counts: torch.Tensor, ep_group: ExpertGroup) -> int:
    """drop_tokens=False: the largest expert load on any rank of the expert-parallel group (None: this rank
    alone). Every rank of the group calls this on every forward, whatever its own routing, so the collective
    always matches."""
    local = exp_counts.max().reshape(1).to(torch.int64) if exp_counts.numel() else torch.zeros(1, dtype=torch.int64)
    if ep_group is not None and comm.get_world_size(as_comm_group(ep_group)) > 1:
        comm.all_reduce(local, op=comm.ReduceOp.MAX, group=as_comm_group(ep_group))
    return int(local.item())


def _first_in_order(mask: torch.Tensor, offset: torch.Tensor | int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots in token order: (locations (S, E), kept (S, E))."""
    loc = torch.cumsum(mask, dim=0) - 1 + offset
    return loc, mask.bool() & (loc < cap)


def _keep_top(mask: torch.Tensor, scores: torch.Tensor, cap: int) -> torch.Tensor:
    """Per expert, keep the ``cap`` routed tokens with the highest ``scores`` (S, E) -> bool (S, E)."""
    cap = min(cap, mask.shape[0])  # a capacity above the number of tokens keeps them all
    if cap <= 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    masked = torch.where(mask.bool(), scores, torch.full_like(scores, -1.0))
    top = torch.topk(masked, cap, dim=0).indices
    chosen = torch.zeros_like(mask, dtype=torch.bool).scatter_(0, top, True)
    return chosen & mask.bool()


def _apply_used(mask: torch.Tensor, used_token: torch.Tensor | None) -> torch.Tensor:
    if used_token is None:
        return mask
    return mask * used_token.reshape(-1, 1).to(mask.dtype)


def route_top1(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: ExpertGroup = None) -> Routing:
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    chooser = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    idx = torch.argmax(chooser, dim=1)
    mask = _apply_used(F.one_hot(idx, E), used_token)
    exp_counts = mask.sum(0)
    l_aux = torch.sum(gates.mean(0) * mask.float().mean(0)) * E
    cap = capacity(S, E, capacity_factor, min_capacity) if drop_tokens else _agreed_capacity(exp_counts, ep_group)
    if use_rts and drop_tokens:
        keep = _keep_top(mask, torch.rand(S, E, device=logits.device), cap)
    else:
        keep = _first_in_order(mask, 0, cap)[1]
    loc = torch.cumsum(keep.long(), dim=0) - 1
    kept = keep.gather(1, idx.unsqueeze(1))
    weights = gates.gather(1, idx.unsqueeze(1)) * kept
    return Routing(experts=idx.unsqueeze(1), weights=weights, locations=loc.gather(1, idx.unsqueeze(1)).clamp_(min=0),
                   kept=kept, capacity=cap, l_aux=l_aux, exp_counts=exp_counts, num_experts=E)


def route_top2(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
               drop_tokens: bool = True, ep_group: ExpertGroup = None,
               top2_2nd_expert_sampling: bool = True) -> Routing:
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    idx1 = torch.argmax(gates, dim=1)
    mask1 = _apply_used(F.one_hot(idx1, E), used_token)
    second = logits + gumbel_rsample(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    idx2 = torch.argmax(second.masked_fill(F.one_hot(idx1, E).bool(), float("-inf")), dim=1)
    mask2 = _apply_used(F.one_hot(idx2, E), used_token)
    exp_counts = (mask1 + mask2).sum(0)
    l_aux = torch.mean(gates.mean(0) * mask1.float().mean(0)) * E * E
    cap = (capacity(S, E, 2 * capacity_factor, min_capacity) if drop_tokens
           else _agreed_capacity(exp_counts, ep_group))
    loc1, keep1 = _first_in_order(mask1, 0, cap)
    loc2, keep2 = _first_in_order(mask2, mask1.sum(0, keepdim=True), cap)
    experts = torch.stack([idx1, idx2], dim=1)
    kept = torch.stack([keep1.gather(1, idx1[:, None]), keep2.gather(1, idx2[:, None])], dim=1).squeeze(2)
    locations = torch.stack([loc1.gather(1, idx1[:, None]), loc2.gather(1, idx2[:, None])], dim=1).squeeze(2)
    raw = gates.gather(1, experts) * kept
    denom = torch.clamp(raw.sum(1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    return Routing(experts=experts, weights=raw / denom, locations=locations.clamp_(min=0), kept=kept, capacity=cap,
                   l_aux=l_aux, exp_counts=exp_counts, num_experts=E)


DROP_POLICIES = ("probs", "position")


def route_topk(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int,
               used_token: torch.Tensor | None = None, drop_tokens: bool = True,
               ep_group: ExpertGroup = None, drop_policy: str = "probs") -> Routing:
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    experts = torch.topk(gates, k, dim=1).indices
    mask = _apply_used(torch.zeros_like(gates, dtype=torch.int64).scatter_(1, experts, 1), used_token)
    exp_counts = mask.sum(0)
    l_aux = torch.mean(gates.mean(0) * mask.float().mean(0)) * E * E / k
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"MoE drop_policy={drop_policy!r}: expected one of {', '.join(DROP_POLICIES)}")
    if drop_tokens:
        cap = capacity(S, E, k * capacity_factor, min_capacity)
        keep = (_keep_top(mask, gates.detach(), cap) if drop_policy == "probs"
                else _first_in_order(mask, 0, cap)[1])
    else:
        cap = _agreed_capacity(exp_counts, ep_group)
        keep = mask.bool()
    loc = torch.cumsum(keep.long(), dim=0) - 1
    kept = keep.gather(1, experts)
    raw = gates.gather(1, experts) * kept
    denom = torch.clamp(raw.sum(1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    return Routing(experts=experts, weights=raw / denom, locations=loc.gather(1, experts).clamp_(min=0), kept=kept,
                   capacity=cap, l_aux=l_aux, exp_counts=exp_counts, num_experts=E)


def _dense(r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    combine, dispatch = r.dense()
    return r.l_aux, combine, dispatch, r.exp_counts


def _gate_output(r: Routing, sparse_routes: bool) -> tuple:
    """The dense tuple, or DeepSpeed's per-route one: ``(l_aux, capacity, num_experts, indices, locations, gates,
    exp_counts)``, each of the last three (k, S) with route j of every token in row j, a dropped route's index
    -1 and its location and gate 0."""
    if not sparse_routes:
        return _dense(r)
    indices = torch.where(r.kept, r.experts, torch.full_like(r.experts, -1))
    locations = torch.where(r.kept, r.locations, torch.zeros_like(r.locations))
    return (r.l_aux, torch.tensor(r.capacity, dtype=torch.int64), r.num_experts, indices.t().to(torch.int32),
            locations.t().to(torch.int32), r.weights.t().contiguous(), r.exp_counts)


def _route_slots(indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Each route's row in the flat ``(num_experts * capacity)`` expert buffer; a dropped route (index -1) gets
    the one extra row after it, which encode leaves at zero and decode reads as zero."""
    rows = indices.long() * capacity + locations.long()
    return rows.masked_fill(indices < 0, num_experts * capacity)


def _sparse_encode(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The ``(num_experts, capacity, model_dim)`` buffer with each kept route's token in its row (unused rows
    zero): what the dense ``einsum("sec,sm->ecm", dispatch_mask, tokens)`` gives, without the (S, E, C) mask."""
    num_tokens, model_dim = tokens.shape
    token_of_route = torch.arange(num_tokens, device=slots.device).expand_as(slots).reshape(-1)
    buffer = tokens.new_zeros(num_experts * capacity + 1, model_dim)
    buffer = buffer.index_put((slots.reshape(-1),), tokens[token_of_route])  # dropped routes land on the last row
    return buffer[:-1].view(num_experts, capacity, model_dim)


def _sparse_decode(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
    """Each token's gate-weighted sum of its routes' rows of ``expert_output`` ``(num_experts * capacity,
    model_dim)``, summed in the gates' precision (fp32) and returned in the experts' dtype."""
    rows = torch.cat([expert_output, expert_output.new_zeros(1, expert_output.shape[-1])])
    total = torch.zeros(num_tokens, expert_output.shape[-1], dtype=torch.promote_types(gates.dtype,
                                                                                       expert_output.dtype),
                        device=expert_output.device)
    for route_rows, route_gates in zip(slots.long(), gates):
        total = total + route_gates.unsqueeze(1) * rows[route_rows]
    return total.to(expert_output.dtype)


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: ExpertGroup = None, sparse_routes: bool = False,
               use_tutel: bool = False) -> tuple[torch.Tensor, ...]:
    """DeepSpeed's ``top1gating``: ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` (``sparse_routes``:
    the per-route tuple, :func:`_gate_output`)."""
    return _gate_output(route_top1(logits.float(), capacity_factor, min_capacity, used_token, noisy_gate_policy,
                                   drop_tokens, use_rts, ep_group), sparse_routes)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: ExpertGroup = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> tuple[torch.Tensor, ...]:
    """DeepSpeed's ``top2gating``: ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` (``sparse_routes``:
    the per-route tuple)."""
    return _gate_output(route_top2(logits.float(), capacity_factor, min_capacity, None, drop_tokens, ep_group,
                                   top2_2nd_expert_sampling), sparse_routes)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: ExpertGroup = None, drop_policy: str = "probs",
               sparse_routes: bool = False) -> tuple[torch.Tensor, ...]:
    """DeepSpeed's ``topkgating``: ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` (``sparse_routes``:
    the per-route tuple)."""
    return _gate_output(route_topk(logits.float(), k, capacity_factor, min_capacity, None, drop_tokens, ep_group,
                                   drop_policy), sparse_routes)


class TopKGate(torch.nn.Module):
    """The gate: ``wg`` maps each token to one logit per expert (in fp32, whatever the model's dtype)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: ExpertGroup = None,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(f"MoE k={k}: expected 1 <= k <= num_experts ({num_experts})")
        if noisy_gate_policy == "None":
            noisy_gate_policy = None
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE noisy_gate_policy={noisy_gate_policy!r}: expected 'Jitter', 'RSample' or None")
        if noisy_gate_policy == "RSample" and k != 1:
            raise ValueError("MoE noisy_gate_policy='RSample' applies to k=1 only (k=2 samples its second expert "
                             "with top2_2nd_expert_sampling)")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.ep_group = ep_group
        self.k = int(k)
        self.num_experts = int(num_experts)
        self.capacity_factor = float(capacity_factor)
        self.eval_capacity_factor = float(eval_capacity_factor)
        self.min_capacity = int(min_capacity)
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = bool(drop_tokens)
        self.use_rts = bool(use_rts)
        self.top2_2nd_expert_sampling = bool(top2_2nd_expert_sampling)
        self.wall_clock_breakdown = False  # when True, gate_time is the last routing's time in ms (DeepSpeed's)
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: ExpertGroup) -> None:
        self.ep_group = ep_group

    def logits(self, input: torch.Tensor) -> torch.Tensor:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        return F.linear(x, self.wg.weight.float())

    def route(self, input: torch.Tensor, used_token: torch.Tensor | None = None,
              drop_tokens: bool | None = None) -> Routing:
        """The sparse routing of ``input`` (S, model_dim)."""
        with timed_into(self, "gate_time"):
            return self._route(input, used_token, drop_tokens)

    def _route(self, input: torch.Tensor, used_token: torch.Tensor | None, drop_tokens: bool | None) -> Routing:
        logits = self.logits(input)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        drop = self.drop_tokens if drop_tokens is None else drop_tokens
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return route_top1(logits, cf, self.min_capacity, used_token, policy, drop, self.use_rts, self.ep_group)
        if self.k == 2:
            return route_top2(logits, cf, self.min_capacity, used_token, drop, self.ep_group,
                              self.top2_2nd_expert_sampling and self.training)
        return route_topk(logits, self.k, cf, self.min_capacity, used_token, drop, self.ep_group)

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None, sparse_routes: bool = False,
                use_tutel: bool = False) -> tuple[torch.Tensor, ...]:
        """DeepSpeed's gate output: ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` (``sparse_routes``:
        the per-route tuple)."""
        return _gate_output(self.route(input, used_token), sparse_routes)
