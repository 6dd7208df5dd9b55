"""A Mixture-of-Experts block marked as a ZeRO-3 leaf (``deepspeed.utils.set_z3_leaf_modules``) trains at ZeRO-3
on two gloo ranks as it does at ZeRO stage 0, although its experts run data-dependently: rank 0's tokens go to
experts 0 and 1, rank 1's to experts 1 and 2, and expert 3 never runs. Without the leaf each rank would gather
only the experts its tokens reach (different collectives on each rank); with it the whole block is gathered at
its pre-hook and each rank reduces a zero gradient for the experts it skipped. Stage 0 and stage 3 do the same
fp32 arithmetic here (a two-rank sum is exact whatever the order, the update is elementwise AdamW), so losses
and weights must agree to a few roundings (rtol 1e-5). Also on the same ranks: DeepSpeed's ``allgather_fn``
and ``reduce_scatter_fn`` across two ranks."""
from __future__ import annotations

import torch
from torch import nn

from tests.harness.runs import ds_config
from tests.helpers import run_ranks

WIDTH, EXPERTS, STEPS, MICRO = 8, 4, 4, 6
ROUTES = {0: (0, 2), 1: (1, 3)}  # rank -> the experts its tokens are routed to (randint's low, high)


class RoutedExperts(nn.Module):
    """Each token goes to the expert its route names, weighted by a learned gate; an expert no token is routed
    to does not run."""

    def __init__(self, width: int, count: int):
        super().__init__()
        self.gate = nn.Linear(width, count)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count))
        self.ran: list[int] = []  # the experts that ran, over the run

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (route == index).nonzero(as_tuple=True)[0]
            if rows.numel():
                self.ran.append(index)
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, index:index + 1])
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.moe = RoutedExperts(WIDTH, EXPERTS)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(h + self.moe(h, route))


def train(rank: int, world: int) -> dict:
    import dsrun
    from dsrun import comm
    from dsrun.utils import set_z3_leaf_modules

    comm.init_distributed(dist_backend="gloo", verbose=False)
    try:
        out: dict = {}
        gathered = torch.zeros(4)
        comm.allgather_fn(gathered, torch.full((2,), float(rank + 1)))
        reduced = torch.zeros(2)
        comm.reduce_scatter_fn(reduced, torch.arange(4.0) * (rank + 1))
        out["collectives"] = (gathered.tolist(), reduced.tolist())
        for stage in (0, 3):
            torch.manual_seed(0)
            model = MoENet()
            set_z3_leaf_modules(model, [RoutedExperts])
            engine = dsrun.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, MICRO, 1))[0]
            inner = [m for m in model.moe.modules() if m is not model.moe]
            hooks = (bool(model.moe._forward_pre_hooks), any(m._forward_pre_hooks for m in inner))
            losses = []
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own tokens
                x, y = torch.randn(MICRO, WIDTH, generator=gen), torch.randn(MICRO, 1, generator=gen)
                route = torch.randint(*ROUTES[rank], (MICRO,), generator=gen)
                loss = nn.functional.mse_loss(engine(x, route), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            with dsrun.zero.GatheredParameters(list(model.parameters())):
                weights = {name: p.detach().clone() for name, p in model.named_parameters()}
            out[stage] = {"losses": losses, "weights": weights, "ran": sorted(set(model.moe.ran)), "hooks": hooks}
            engine.destroy()
        return out
    finally:
        comm.destroy_process_group()


def test_a_leaf_moe_block_whose_experts_run_per_rank_trains_at_zero3_as_at_stage0() -> None:
    ranks = run_ranks(train, 2, timeout=300)
    assert ranks[0][3]["ran"] == [0, 1] and ranks[1][3]["ran"] == [1, 2]  # each rank skipped other experts
    assert ranks[0][3]["hooks"] == (True, False)  # ZeRO-3 hooked the leaf, not its experts
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(result[3]["losses"]), torch.tensor(result[0]["losses"]),
                                   rtol=1e-5, atol=0)
        for name, weight in result[0]["weights"].items():
            torch.testing.assert_close(result[3]["weights"][name], weight, rtol=1e-5, atol=1e-7, msg=name)
    for rank, result in enumerate(ranks):
        gathered, reduced = result["collectives"]
        assert gathered == [1.0, 1.0, 2.0, 2.0]  # rank r's piece at r
        assert reduced == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]  # the sum over both ranks of piece r
