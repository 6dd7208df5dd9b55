"""``deepspeed.moe.sharded_moe``: the gate, the token exchange between expert-parallel ranks, the experts.

:class:`MOELayer` runs one MoE layer on S tokens of this rank:

1. the gate routes each token to k experts (:mod:`.gating`);
2. **capacity path** (DeepSpeed's): every expert gets a buffer of C slots; the kept tokens are copied into
   their slots, giving ``(E, C, M)``, which is laid out ``(ep, E_local, C, M)`` (global expert
   ``e = ep_rank * E_local + j``), so one ``all_to_all_single`` over the expert-parallel group sends each rank
   the slots of its own experts from every rank; the experts run on ``(ep, E_local, C, M)`` and a second
   all-to-all brings the results back. Each all-to-all moves ``E * C * M`` elements per rank (its own
   ``1/ep`` share stays); backward does the same two again;
3. **dropless path** (beyond DeepSpeed, ``MoE(..., dropless=True)``): no capacity; the k choices of every token
   are sorted by expert, the per-expert counts are exchanged first (one small all-to-all of E integers), then
   exactly the routed rows move (``all_to_all_single`` with split sizes), each local expert runs once on all
   its rows, and the rows return the same way;
4. the token's output is the weighted sum of its k expert outputs, in choice order.

Both paths give the same result when nothing is dropped (``drop_tokens=False``): the same rows go through the
same experts and are summed in the same order. With ``ep_size == 1`` no collective runs at all.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from dsrun import comm

from .experts import Experts
from .gating import (ExpertGroup, Routing, TopKGate, WORLD, as_comm_group, gumbel_rsample, timed_into,
                     multiplicative_jitter, top1gating, top2gating, topkgating, _route_slots, _sparse_decode,
                     _sparse_encode)

dist = comm  # DeepSpeed's name for the comm module in this one (its tests patch ``sharded_moe.dist.all_reduce``)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group`` (dim 0), differentiable: backward sends the gradients back."""

    @staticmethod
    def forward(ctx: FunctionCtx, group: ExpertGroup, input: torch.Tensor, output_splits: list[int] | None = None,
                input_splits: list[int] | None = None) -> torch.Tensor:
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        input = input.contiguous()
        if output_splits is None:
            output = torch.empty_like(input)
        else:
            output = input.new_empty((sum(output_splits),) + tuple(input.shape[1:]))
        comm.all_to_all_single(output, input, output_splits, input_splits, group=as_comm_group(group))
        return output

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[Any, ...]:
        output_splits, input_splits = ctx.splits
        return None, _AllToAll.apply(ctx.group, grad, input_splits, output_splits), None, None


def combine(rows: torch.Tensor, routing: Routing, slot: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its k expert outputs (choice order); ``rows[slot[s, j]]`` is the output
    of choice j of token s."""
    weights = routing.weights.to(rows.dtype)
    out = weights[:, 0:1] * rows[slot[:, 0]]
    for j in range(1, slot.shape[1]):
        out = out + weights[:, j:j + 1] * rows[slot[:, j]]
    return out


class MOELayer(torch.nn.Module):
    """Gate + experts + the exchange between the ranks of the expert-parallel group."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False, dropless: bool = False):
        super().__init__()
        if use_tutel:
            raise ValueError("MoE use_tutel=True: Tutel is not part of dsrun; leave use_tutel=False (the "
                             "all-to-all path is used)")
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = int(ep_size)
        self.num_local_experts = int(num_local_experts)
        self.num_experts = self.ep_size * self.num_local_experts
        self.dropless = bool(dropless)
        self.ep_group: ExpertGroup = None  # None: this rank alone (ep_size 1); else the group, WORLD: the world
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.last_routing: Routing | None = None
        self.use_tutel = False
        # DeepSpeed's breakdown of the last forward, in ms, recorded while ``wall_clock_breakdown`` is True (the
        # engine switches it on with the config key of that name): the whole layer, the first (dispatch) and
        # second (return) all-to-all; the gate's top-k time is ``gate.gate_time``
        self.wall_clock_breakdown = False
        self.time_moe = self.time_falltoall = self.time_salltoall = 0.0

    def _set_ep_group(self, ep_group: ExpertGroup) -> None:
        self.ep_group = WORLD if (ep_group is None and self.ep_size > 1) else ep_group
        self.gate._set_ep_group(self.ep_group)

    def _exchange(self, x: torch.Tensor, output_splits: list[int] | None = None,
                  input_splits: list[int] | None = None, timer: str = "time_falltoall") -> torch.Tensor:
        if self.ep_size == 1:
            return x
        with timed_into(self, timer):
            if output_splits is None and input_splits is None:  # DeepSpeed's call, (group, input)
                return _AllToAll.apply(self.ep_group, x)
            return _AllToAll.apply(self.ep_group, x, output_splits, input_splits)

    def forward(self, *input: torch.Tensor, **kwargs: torch.Tensor | None) -> torch.Tensor:
        with timed_into(self, "time_moe"):
            return self._forward(*input, **kwargs)

    def _forward(self, *input: torch.Tensor, **kwargs: torch.Tensor | None) -> torch.Tensor:
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        d_model = hidden.shape[-1]
        x = hidden.reshape(-1, d_model)
        if self.dropless:
            routing = self._route_local(x, used_token)
            out = self._dropless(x, routing)
        else:
            routing = self.gate.route(x, used_token)
            out = self._with_capacity(x, routing)
        self.l_aux, self.exp_counts, self.last_routing = routing.l_aux, routing.exp_counts, routing
        return out.reshape(hidden.shape)

    def _route_local(self, x: torch.Tensor, used_token: torch.Tensor | None) -> Routing:
        """Dropless routing needs no agreed capacity: route as drop_tokens=False on this rank alone."""
        group, self.gate.ep_group = self.gate.ep_group, None
        try:
            return self.gate.route(x, used_token, drop_tokens=False)
        finally:
            self.gate.ep_group = group

    # --- DeepSpeed's path: fixed capacity, two equal all-to-alls --------------------------------------------
    def _with_capacity(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        S, M = x.shape
        E, C = self.num_experts, routing.capacity
        slot = routing.experts * C + routing.locations  # (S, k) row of each choice in the (E * C) buffer
        tokens = torch.arange(S, device=x.device).unsqueeze(1).expand_as(slot)
        keep = routing.kept
        buffer = x.new_zeros(E * C, M).index_add(0, slot[keep], x[tokens[keep]])
        dispatched = self._exchange(buffer.reshape(self.ep_size, self.num_local_experts, C, M))
        expert_out = self.experts(dispatched)
        returned = self._exchange(expert_out.contiguous(), timer="time_salltoall").reshape(E * C, M)
        if E * C == 0:
            return x.new_zeros(S, M) + 0 * x
        return combine(returned, routing, slot.clamp(max=E * C - 1) * keep)

    # --- dropless: rows sorted by expert, variable all-to-all -----------------------------------------------
    def _dropless(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        S, M = x.shape
        E, L, ep = self.num_experts, self.num_local_experts, self.ep_size
        keep = routing.kept.reshape(-1)
        expert_of = routing.experts.reshape(-1)
        choices = torch.arange(expert_of.numel(), device=x.device)[keep]
        order = choices[torch.argsort(expert_of[keep], stable=True)]  # kept choices sorted by expert
        counts = torch.bincount(expert_of[order], minlength=E)  # rows for each global expert
        rows = x[order // routing.experts.shape[1]]
        send = counts.reshape(ep, L).sum(1).tolist()
        if ep > 1:
            received = torch.empty_like(counts)
            comm.all_to_all_single(received, counts, group=as_comm_group(self.ep_group))
        else:
            received = counts
        per_source = received.reshape(ep, L)  # rows from each source rank for each local expert
        recv = per_source.sum(1).tolist()
        arrived = self._exchange(rows, recv, send)  # ordered [source][local expert][rows]
        # regroup [local expert][source] so each expert runs once on all its rows
        starts = torch.cumsum(per_source.reshape(-1), 0) - per_source.reshape(-1)
        pieces = [(int(starts[s * L + j]), int(per_source[s, j])) for j in range(L) for s in range(ep)]
        perm = torch.cat([torch.arange(a, a + n, device=x.device) for a, n in pieces]) if pieces else \
            torch.zeros(0, dtype=torch.long, device=x.device)
        grouped = arrived[perm]
        sizes = per_source.sum(0).tolist()  # rows per local expert
        outs = [self.experts.run(j, chunk) for j, chunk in enumerate(torch.split(grouped, sizes))]
        done = torch.empty_like(grouped) if not outs else torch.cat(outs)
        back = torch.empty_like(done).index_copy(0, perm, done) if perm.numel() else done
        returned = self._exchange(back, send, recv, timer="time_salltoall")
        per_choice = x.new_zeros(expert_of.numel(), M).index_copy(0, order, returned)
        slot = torch.arange(expert_of.numel(), device=x.device).reshape(routing.experts.shape)
        return combine(per_choice, routing, slot)


__all__ = ["MOELayer", "TopKGate", "combine", "dist", "gumbel_rsample", "multiplicative_jitter", "top1gating",
           "top2gating", "topkgating", "_AllToAll", "_route_slots", "_sparse_decode", "_sparse_encode"]
