"""Expert parallelism is exact: ep=2 on 2 gloo ranks against ep=1 holding every expert, on the same shards.

One launch runs every case (``moe_suite``): the MoE layer alone for k = 1, 2, 3 with token dropping, with
``drop_tokens=False`` and with the dropless path (outputs, ``l_aux``, every gradient, the logged all-to-all
bytes), a deliberately skewed routing with ``drop_tokens=False`` (ranks need different capacities: they must
agree, not hang), and the engine at ZeRO stages 0-3 (one SGD step of the harness's ``moe_net/ep2``; the new
weights, and the weights minus ``safe_get_full_grad`` read before the step, equal those of ``moe_net/ep1``
stepped by ``reference_run`` on both shards). Tolerances come from fp32
arithmetic (``tests.tolerance.fp32_sum_bound``): the two sides sum the same terms in a different order.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.harness.launch import Launch, Runs
from tests.harness.models import MOE_D as D, MOE_EXPERTS as EXPERTS, MOE_TOKENS as TOKENS
from tests.harness.models import build_model, global_expert_name, init_experts, make_moe, moe_shard
from tests.harness.runs import ds_config, full_moe_params, reference_run
from tests.tolerance import fp32_sum_bound as fp32_bound

# multi-process launches (tens of seconds each on a loaded 2-core machine): slow, as the engine parity tests
pytestmark = pytest.mark.slow

U = 2.0 ** -24


# --- the layer alone: ep=world on this rank's shard against ep=1 on every shard ---------------------------------
def shard_tokens(rank: int, skew: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(TOKENS, D, generator=gen)
    if skew and rank == 0:
        x = x.abs() * 3  # with the skewing gate below, nearly every token of rank 0 wants expert 0
    return x


def cotangent(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(90 + rank))


def skew_gate(layer: nn.Module) -> None:
    with torch.no_grad():
        w = layer.deepspeed_moe.gate.wg.weight
        w.zero_()
        w[0].fill_(1.0)  # positive inputs score expert 0 highest
        w[1:, 0] = torch.tensor([0.3, -0.2, 0.1])


def named_grads(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by global name: local expert j is reported under its global id."""
    ids = layer.global_expert_ids()
    return {global_expert_name(name, ids): p.grad.detach().clone() for name, p in layer.named_parameters()
            if p.grad is not None}


def layer_case(rank: int, world: int, k: int, drop_tokens: bool, dropless: bool, residual: bool,
               skew: bool = False) -> dict[str, Any]:
    """ep=world layer on this rank's shard vs an ep=1 layer on every shard: outputs, l_aux, gradients of
    the mean of the per-rank losses (dense gradients averaged over ranks, expert gradients divided by the
    data-parallel size: the engine's scaling)."""
    from dsrun import comm

    layer = make_moe(world, k, drop_tokens, dropless, residual)
    if skew:
        skew_gate(layer)
    init_experts(layer)
    before = comm.get_comms_stats().get("all_to_all_single", {"count": 0, "message_bytes": 0})
    x = shard_tokens(rank, skew).requires_grad_()  # as inside a model: the dispatch needs its backward too
    out, l_aux, counts = layer(x)
    loss = (out * cotangent(rank)).sum() + 0.1 * l_aux
    loss.backward()
    after = comm.get_comms_stats().get("all_to_all_single", {"count": 0, "message_bytes": 0})
    for p in layer.parameters():
        if getattr(p, "allreduce", True):
            comm.all_reduce(p.grad)
        p.grad.div_(world)
    grads = named_grads(layer)

    ref = make_moe(1, k, drop_tokens, dropless, residual)
    if skew:
        skew_gate(ref)
    init_experts(ref)
    ref_out, ref_aux = None, None
    total = 0.0
    for r in range(world):
        o, a, _ = ref(shard_tokens(r, skew))
        total = total + ((o * cotangent(r)).sum() + 0.1 * a) / world
        if r == rank:
            ref_out, ref_aux = o.detach(), a.detach()
    total.backward()
    ref_grads = named_grads(ref)
    routing = layer.deepspeed_moe.last_routing
    return {"out": out.detach().numpy(), "ref_out": ref_out.numpy(), "l_aux": float(l_aux.detach()),
            "ref_l_aux": float(ref_aux),
            "grads": {n: g.numpy() for n, g in grads.items() if n in ref_grads or ".deepspeed_experts." not in n},
            "ref_grads": {n: ref_grads[n].numpy() for n in grads if n in ref_grads},
            "capacity": routing.capacity, "a2a_count": after["count"] - before["count"],
            "a2a_bytes": after["message_bytes"] - before["message_bytes"], "counts": counts.tolist()}


def layer_suite(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for k in (1, 2, 3):
        out[f"k{k}/drop"] = layer_case(rank, world, k, True, False, residual=(k == 2))
        out[f"k{k}/nodrop"] = layer_case(rank, world, k, False, False, residual=False)
        out[f"k{k}/dropless"] = layer_case(rank, world, k, False, True, residual=False)
    out["skew/nodrop"] = layer_case(rank, world, 1, False, False, False, skew=True)
    out["skew/dropless"] = layer_case(rank, world, 1, False, True, False, skew=True)
    return out


# --- the engine: one SGD step of ep=world against ep=1 on every shard ---------------------------------------------
def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def engine_case(rank: int, world: int, stage: int) -> dict[str, Any]:
    """One SGD step (lr 1) of the ep=world engine vs the ep=1 model stepped on the mean of the per-rank
    losses: the new weights differ by the gradients' difference (plus one rounding of w - g)."""
    import dsrun
    from dsrun.utils import safe_get_full_grad

    # the reference steps by the raw mean gradient: no clipping
    cfg = ds_config(stage, TOKENS, 1, bucket=64, zero={"allgather_bucket_size": 64,
                                                      "stage3_param_persistence_threshold": 0},
                    client_optimizer=True, zero_allow_untested_optimizer=True)
    engine, _, _, _ = dsrun.initialize(model=build_model(f"moe_net/ep{world}"), config=cfg, optimizer=sgd)
    before = full_moe_params(engine)
    loss = engine(moe_shard(rank))
    engine.backward(loss)
    # DeepSpeed's safe_get_full_grad, read before the step: an expert's is gathered over its expert-data group
    ids = engine.module.moe.global_expert_ids()
    read = {global_expert_name(n, ids): safe_get_full_grad(p).detach().float()
            for n, p in engine.module.named_parameters()}
    engine.step()
    got = full_moe_params(engine)
    engine.destroy()

    def shards(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [moe_shard(r) for r in range(world)]  # the reference's micro-batch r is rank r's shard
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    ref = reference_run("moe_net/ep1", 1, world * TOKENS, parts=world, optimizer=sgd, batch_at=shards,
                        flat=lambda model: {n: p.detach().clone() for n, p in model.named_parameters()})["params"]
    return {"got": {n: t.numpy() for n, t in got.items()}, "ref": {n: ref[n].numpy() for n in got},
            "stepped_by_read_grad": {n: (before[n] - read[n]).numpy() for n in got}}  # SGD, lr 1: w - g


def engine_suite(rank: int, world: int) -> dict[str, Any]:
    return {f"zero{stage}": engine_case(rank, world, stage) for stage in (0, 1, 2, 3)}


# --- AutoEP's layer (dsrun/autoep): dropless token-choice routing over the same all-to-all ------------------
def autoep_block() -> nn.Module:
    """A Mixtral-style block (fused 3-D expert weights, Transformers >= 5) inside a model AutoEP can parse."""
    gen = torch.Generator().manual_seed(7)
    block = nn.Module()
    block.gate = nn.Linear(D, EXPERTS, bias=False)
    block.gate.weight.data = torch.randn(EXPERTS, D, generator=gen)
    block.experts = nn.Module()
    block.experts.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * D, D, generator=gen) * 0.3)
    block.experts.down_proj = nn.Parameter(torch.randn(EXPERTS, D, D, generator=gen) * 0.3)
    return block


def autoep_layer(ep: int, rank: int) -> nn.Module:
    from dsrun.autoep.config import parse_autoep_config
    from dsrun.autoep.detect import AutoEP
    from dsrun.autoep.layer import AutoEPMoELayer

    model = nn.Module()
    model.config = type("Cfg", (), {"num_local_experts": EXPERTS, "num_experts_per_tok": 2})()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].mlp = autoep_block()
    config = parse_autoep_config({"enabled": True, "autoep_size": ep, "preset_model": "mixtral",
                                  "use_grouped_mm": False})
    spec = AutoEP(model, config).ep_parser()[0]
    layer = AutoEPMoELayer(spec, model.model.layers[0].mlp, ep_size=ep, ep_rank=rank, config=config)
    if ep > 1:
        layer.set_deepspeed_parallelism()
    return layer


def autoep_case(rank: int, world: int) -> dict[str, Any]:
    """AutoEP's layer with ep=world on this rank's shard vs ep=1 on every shard: outputs and the gradients of
    the mean of the per-rank losses (this rank's experts against the same experts of the ep=1 layer)."""
    from dsrun import comm

    layer = autoep_layer(world, rank)
    out = layer(shard_tokens(rank).reshape(1, TOKENS, D))
    (out.reshape(TOKENS, D) * cotangent(rank)).sum().div(world).backward()
    comm.all_reduce(layer.router.gate.weight.grad)  # replicated: reduced over the data-parallel group
    ref = autoep_layer(1, 0)
    total = 0.0
    for r in range(world):
        o = ref(shard_tokens(r).reshape(1, TOKENS, D)).reshape(TOKENS, D)
        total = total + (o * cotangent(r)).sum() / world
        if r == rank:
            ref_out = o.detach()
    total.backward()
    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    ref_grads = {n: p.grad[local] if n.startswith("experts.") else p.grad for n, p in ref.named_parameters()}
    return {"out": out.detach().reshape(TOKENS, D).numpy(), "ref_out": ref_out.numpy(),
            "grads": {n: g.numpy() for n, g in grads.items()}, "ref_grads": {n: g.numpy() for n, g in ref_grads.items()},
            "local_experts": layer.num_local_experts}


def folded_dispatch_case(rank: int, world: int) -> dict[str, Any]:
    """AutoEP's dispatch folded over AutoTP (``dsrun.autoep.ep_tp_dispatch``), the world as the TP group: every
    rank routes the same 6 tokens to top-2 of 4 experts; each keeps its share of the assignments, the outputs are
    restored over the group. Against the unpartitioned combine on every rank: the restored output, and the
    gradients of the per-rank losses (summed over the group) of the expert outputs and of the router's scores;
    and a payload one rank routes differently is refused on every rank."""
    from dsrun.autoep.ep_tp_dispatch import (RoutedAssignmentPayload, assert_tp_payload_consistent,
                                             assignment_ordinals_by_expert, dispatch_counters, partition_assignments,
                                             restore_combined)
    from dsrun.autoep.layer import combine_from_routed
    from dsrun import comm

    gen = torch.Generator().manual_seed(7)  # the same routing on every rank, as folded TP ranks have it
    tokens, top_k, experts, hidden = 6, 2, 4, 3
    scores = torch.softmax(torch.randn(tokens, experts, generator=gen), -1)
    top_scores, top_experts = torch.topk(scores, top_k, -1)
    order = torch.argsort(top_experts.reshape(-1), stable=True)  # flat (token, slot) rows sorted by expert
    expert_of_row = top_experts.reshape(-1)[order]
    expert_out = torch.randn(order.numel(), hidden, generator=gen)

    def payload(weights: torch.Tensor) -> Any:
        return RoutedAssignmentPayload(
            token_indices=order // top_k, expert_indices=expert_of_row,
            assignment_indices=assignment_ordinals_by_expert(expert_of_row), capacity_slots=order % top_k,
            combine_weights=weights.reshape(-1).index_select(0, order),
            drop_mask=torch.zeros(order.numel(), dtype=torch.bool), pad_mask=torch.zeros(order.numel(), dtype=torch.bool),
            input_splits=torch.bincount(expert_of_row, minlength=experts).tolist(),
            output_splits=torch.bincount(expert_of_row, minlength=experts).tolist(),
            extra={"destination_ranks": expert_of_row, "num_tokens": torch.tensor(tokens)})

    ref_out, ref_scores = expert_out.clone().requires_grad_(), top_scores.clone().requires_grad_()
    reference = combine_from_routed(ref_out, ref_scores, order, top_k, "post", "weighted_sum", (1, tokens, hidden))
    sum((reference * (r + 1)).square().sum() for r in range(world)).backward()

    out, weights = expert_out.clone().requires_grad_(), top_scores.clone().requires_grad_()
    routed = payload(weights)
    assert_tp_payload_consistent(routed, tp_group=None, tp_size=world)
    local, ctx = partition_assignments(routed, tp_group=None, tp_rank=rank, tp_size=world)
    restored = restore_combined(out.index_select(0, ctx.local_indices), ctx, tp_group=None, validate_coverage=True)
    (restored * (rank + 1)).square().sum().backward()
    out_grad, score_grad = out.grad.clone(), weights.grad.clone()
    comm.all_reduce(out_grad)
    comm.all_reduce(score_grad)
    skewed = payload(top_scores + (0.25 if rank == 1 else 0.0))
    try:
        assert_tp_payload_consistent(skewed, tp_group=None, tp_size=world)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    return {"restored": restored.detach().numpy(), "reference": reference.detach().reshape(tokens, hidden).numpy(),
            "out_grad": out_grad.numpy(), "ref_out_grad": ref_out.grad.numpy(), "score_grad": score_grad.numpy(),
            "ref_score_grad": ref_scores.grad.numpy(), "counters": dispatch_counters(ctx),
            "local_experts": local.expert_indices.tolist(), "refused": refused}


def moe_suite(rank: int, world: int) -> dict[str, Any]:
    """Rank entry point: the layer cases, AutoEP's layer, then the engine's."""
    from dsrun import comm

    torch.set_num_threads(1)
    comm.init_distributed()
    return {"layer": layer_suite(rank, world), "autoep": autoep_case(rank, world),
            "folded": folded_dispatch_case(rank, world), "engine": engine_suite(rank, world)}


def analytic_a2a_bytes(tokens: int, k: int, ep: int, capacity_factor: float = 1.0, min_capacity: int = 1) -> int:
    """Message bytes of one MoE layer's forward and backward with drop_tokens: four all-to-alls of the
    (E, C, M) fp32 buffer."""
    cap = max(0, min(max(math.ceil(tokens * k * capacity_factor / EXPERTS), min_capacity), tokens))
    return 4 * EXPERTS * cap * D * 4


LAUNCHES = {"suite": Launch(moe_suite, 2, timeout=420)}


def collect(runs: Runs) -> list[dict]:
    return runs["suite"]


def _close(a: np.ndarray, b: np.ndarray, n_terms: int, what: str) -> None:
    scale = max(1.0, float(np.abs(b).max()))
    bound = fp32_bound(n_terms, scale)
    diff = float(np.abs(a - b).max())
    assert diff <= max(bound, 1e-6 * scale), f"{what}: |diff| {diff} > bound {bound}"


def test_layer_output_aux_and_gradients_match_ep1(runs) -> None:
    for rank, result in enumerate(runs):
        for key, case in result["layer"].items():
            k = int(key[1]) if key.startswith("k") else 1
            n_terms = 2 * TOKENS * k  # a gradient sums at most every token's k choices of both shards
            _close(case["out"], case["ref_out"], k + 1, f"rank {rank} {key} output")
            assert abs(case["l_aux"] - case["ref_l_aux"]) <= 4 * EXPERTS * U * max(1.0, case["ref_l_aux"]), key
            assert set(case["grads"]) == set(case["ref_grads"]), key
            for name, grad in case["grads"].items():
                _close(grad, case["ref_grads"][name], n_terms, f"rank {rank} {key} grad {name}")


def test_autoep_layer_output_and_gradients_match_ep1(runs) -> None:
    for rank, result in enumerate(runs):
        case = result["autoep"]
        assert case["local_experts"] == EXPERTS // 2
        _close(case["out"], case["ref_out"], 2 + 1, f"rank {rank} AutoEP output")  # k=2 expert outputs summed
        assert set(case["grads"]) == set(case["ref_grads"])
        for name, grad in case["grads"].items():
            _close(grad, case["ref_grads"][name], 2 * TOKENS * 2, f"rank {rank} AutoEP grad {name}")


def test_folded_dispatch_restores_the_unpartitioned_combine(runs) -> None:
    """Each (token, expert) assignment computed by exactly one TP rank; the restored output equal bit for bit to the
    unpartitioned combine (the same products added slot by slot); the summed gradients of the expert outputs and
    router scores within fp32's bound of the reference's; a divergent routing refused on both ranks."""
    kept = [r["folded"]["counters"]["assignments_local"] for r in runs]
    assert sum(kept) == runs[0]["folded"]["counters"]["assignments_total"] == 6 * 2 and min(kept) > 0
    for rank, result in enumerate(runs):
        case = result["folded"]
        np.testing.assert_array_equal(case["restored"], case["reference"])
        # a gradient sums the 2 ranks' loss terms, each a product of a few fp32 factors
        _close(case["out_grad"], case["ref_out_grad"], 2 * 4, f"rank {rank} folded expert-output grad")
        _close(case["score_grad"], case["ref_score_grad"], 2 * 4, f"rank {rank} folded router-score grad")
        assert "routing decisions differ across tensor-parallel lanes" in case["refused"], case["refused"]


def test_skewed_routing_without_dropping_agrees_on_capacity_and_matches_dropless(runs) -> None:
    results = runs  # finishing at all (run_ranks' timeout) is the no-hang half of this test
    caps = [r["layer"]["skew/nodrop"]["capacity"] for r in results]
    loads = [max(r["layer"]["skew/nodrop"]["counts"]) for r in results]
    assert loads[0] != loads[1], "the fixture must give the ranks different loads"
    assert caps == [max(loads)] * 2
    for r in results:
        np.testing.assert_allclose(r["layer"]["skew/nodrop"]["out"], r["layer"]["skew/dropless"]["out"],
                                   rtol=0, atol=fp32_bound(2, float(np.abs(r["layer"]["skew/dropless"]["out"]).max())))


def test_logged_all_to_all_bytes_equal_the_analytic_count(runs) -> None:
    for result in runs:
        for k in (1, 2, 3):
            case = result["layer"][f"k{k}/drop"]
            assert case["a2a_count"] == 4  # dispatch and return, forward and backward
            assert case["a2a_bytes"] == analytic_a2a_bytes(TOKENS, k, ep=2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_step_matches_ep1_reference(runs, stage: int) -> None:
    for rank, result in enumerate(runs):
        case = result["engine"][f"zero{stage}"]
        assert set(case["got"]) == set(case["ref"])
        for name, value in case["got"].items():
            _close(value, case["ref"][name], 2 * TOKENS * 2, f"rank {rank} ZeRO-{stage} {name}")
            _close(case["stepped_by_read_grad"][name], case["ref"][name], 2 * TOKENS * 2,
                   f"rank {rank} ZeRO-{stage} {name}: safe_get_full_grad")
