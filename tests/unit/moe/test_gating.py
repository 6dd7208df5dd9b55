"""Gating against plain reference loops: capacities, kept and dropped choices, slots, weights, l_aux."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.moe import gating
from dsrun.moe.layer import MoE
from dsrun.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

S, E = 23, 4


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(S, E, generator=torch.Generator().manual_seed(seed)) * 2


def reference_in_order(choices: list[list[int]], cap: int) -> tuple[list[list[bool]], list[list[int]]]:
    """Choice j of every token takes a slot before choice j+1 of any token; within a choice, token order."""
    load = [0] * E
    kept = [[False] * len(c) for c in choices]
    slot = [[-1] * len(c) for c in choices]
    for j in range(len(choices[0])):
        for s, c in enumerate(choices):
            if load[c[j]] < cap:
                kept[s][j], slot[s][j] = True, load[c[j]]
            load[c[j]] += 1
    return kept, slot


@pytest.mark.parametrize("cf,min_cap", [(1.0, 4), (0.5, 1), (2.0, 1), (1.0, 40)])
def test_top1_capacity_and_drops_equal_a_reference_loop(cf: float, min_cap: int) -> None:
    lg = logits()
    r = gating.route_top1(lg, cf, min_cap, use_rts=False)
    cap = max(math.ceil(S / E * cf), min_cap)  # DeepSpeed 0.19: min_cap 40 > 23 tokens is the width
    assert r.capacity == cap
    choices = [[int(i)] for i in lg.softmax(1).argmax(1)]
    kept, slot = reference_in_order(choices, cap)
    assert r.kept[:, 0].tolist() == [k[0] for k in kept]
    assert [int(x) for x, k in zip(r.locations[:, 0], r.kept[:, 0]) if k] == [s[0] for s, k in zip(slot, kept) if k[0]]
    assert r.dropped == sum(not k[0] for k in kept)
    assert r.exp_counts.tolist() == [sum(c[0] == e for c in choices) for e in range(E)]


def test_top1_random_token_selection_keeps_the_highest_random_scores() -> None:
    lg = logits(1)
    torch.manual_seed(5)
    r = gating.route_top1(lg, 0.5, 1, use_rts=True)
    torch.manual_seed(5)
    scores = torch.rand(S, E)  # the same draw the gate made
    best = lg.softmax(1).argmax(1)
    for e in range(E):
        mine = [s for s in range(S) if best[s] == e]
        want = sorted(sorted(mine, key=lambda s: -float(scores[s, e]))[:r.capacity])
        assert [s for s in mine if r.kept[s, 0]] == want


def test_top2_slots_and_renormalised_weights_equal_a_reference_loop() -> None:
    lg = logits(2)
    r = gating.route_top2(lg, 0.5, 1, top2_2nd_expert_sampling=False)
    assert r.capacity == max(math.ceil(S * 2 * 0.5 / E), 1)
    probs = lg.softmax(1)
    choices = [[int(i) for i in torch.topk(probs[s], 2).indices] for s in range(S)]
    kept, slot = reference_in_order(choices, r.capacity)
    assert r.experts.tolist() == choices
    assert r.kept.tolist() == kept
    for s in range(S):
        raw = [float(probs[s, c]) if k else 0.0 for c, k in zip(choices[s], kept[s])]
        total = max(sum(raw), torch.finfo(torch.float32).eps)
        assert r.weights[s].tolist() == pytest.approx([x / total for x in raw], abs=1e-7)
        assert [int(x) for x, k in zip(r.locations[s], kept[s]) if k] == [x for x, k in zip(slot[s], kept[s]) if k]


def test_top3_keeps_the_most_probable_tokens_per_expert() -> None:
    lg = logits(3)
    r = gating.route_topk(lg, 3, 0.5, 1)
    probs = lg.softmax(1)
    assert r.capacity == max(math.ceil(S * 3 * 0.5 / E), 1)
    for e in range(E):
        routed = [s for s in range(S) if e in r.experts[s].tolist()]
        want = set(sorted(routed, key=lambda s: -float(probs[s, e]))[:r.capacity])
        got = {s for s in routed if r.kept[s, r.experts[s].tolist().index(e)]}
        assert got == want
    assert r.dropped == 3 * S - int(r.kept.sum())


def test_aux_loss_is_E_times_sum_of_f_times_P_on_a_fixture() -> None:
    # 4 tokens, 2 experts: first choices 0, 0, 0, 1 -> f = (3/4, 1/4)
    lg = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.5, 0.0], [0.0, 3.0]])
    p = lg.softmax(1).mean(0)
    expected = 2 * (0.75 * float(p[0]) + 0.25 * float(p[1]))
    assert float(gating.route_top1(lg, 1.0, 1, use_rts=False).l_aux) == pytest.approx(expected, rel=1e-6)
    assert float(gating.route_top2(lg, 1.0, 1, top2_2nd_expert_sampling=False).l_aux) == pytest.approx(expected, rel=1e-6)
    # k = E: every token picks every expert, f_i = k / k = 1 for each after dividing by k
    assert float(gating.route_topk(lg, 2, 1.0, 1).l_aux) == pytest.approx(2 * float(p.sum()) / 2, rel=1e-6)


def test_dense_tuple_matches_the_sparse_routing() -> None:
    lg = logits(4)
    l_aux, combine, dispatch, counts = gating.top2gating(lg, 1.0, 1, top2_2nd_expert_sampling=False)
    r = gating.route_top2(lg, 1.0, 1, top2_2nd_expert_sampling=False)
    assert combine.shape == (S, E, r.capacity) and torch.equal(dispatch, combine.bool())
    assert torch.allclose(combine.sum((1, 2)), r.weights.sum(1))
    assert int(dispatch.sum()) == int(r.kept.sum()) and torch.equal(counts, r.exp_counts)


def test_noise_policies_act_only_while_training() -> None:
    gate = gating.TopKGate(8, E, k=1, noisy_gate_policy="Jitter")
    x = torch.randn(64, 8)
    assert not torch.equal(gate.logits(x), gate.logits(x))  # jittered input
    gate.eval()
    assert torch.equal(gate.logits(x), gate.logits(x))
    rs = gating.TopKGate(8, E, k=1, noisy_gate_policy="RSample", min_capacity=64)
    plain = gating.TopKGate(8, E, k=1, min_capacity=64)
    plain.load_state_dict(rs.state_dict())
    torch.manual_seed(0)
    assert not torch.equal(rs.route(x).experts, plain.route(x).experts)  # Gumbel noise changes choices
    rs.eval()
    assert torch.equal(rs.route(x).experts, plain.route(x).experts)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        gating.TopKGate(8, E, noisy_gate_policy="Gaussian")


def test_capacity_larger_than_the_tokens_does_not_crash() -> None:
    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=1, min_capacity=100)
    out, _, _ = layer(torch.randn(3, 8))
    # DeepSpeed 0.19's width (min_capacity), every token kept: an expert cannot be sent more than all 3
    assert out.shape == (3, 8) and layer.deepspeed_moe.last_routing.capacity == 100
    assert bool(layer.deepspeed_moe.last_routing.kept.all())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_routes_encode_and_decode_as_the_dense_masks(k: int) -> None:
    lg, hidden = logits(6), torch.randn(S, 5, generator=torch.Generator().manual_seed(7))
    args = dict(top2_2nd_expert_sampling=False) if k == 2 else dict(use_rts=False) if k == 1 else {}
    gate = {1: gating.top1gating, 2: gating.top2gating}.get(k, lambda *a, **kw: gating.topkgating(a[0], k, *a[1:], **kw))
    _, combine, dispatch, counts = gate(lg, 0.5, 1, **args)
    _, cap, n_exp, indices, locations, gates, sparse_counts = gate(lg, 0.5, 1, sparse_routes=True, **args)
    assert (int(cap), n_exp) == (combine.shape[2], E) and indices.shape == (k, S) and torch.equal(counts, sparse_counts)
    assert int((indices >= 0).sum()) == int(dispatch.sum())  # a dropped route is -1
    slots = gating._route_slots(indices, locations, E, int(cap))
    # each kept route copies one token (x * 1.0 plus zeros is exact) and decode sums k fp32 products per token
    assert torch.equal(gating._sparse_encode(hidden, slots, E, int(cap)),
                       torch.einsum("sec,sm->ecm", dispatch.float(), hidden))
    out = torch.randn(E * int(cap), 5)
    expected = torch.einsum("sec,ecm->sm", combine, out.view(E, int(cap), 5))
    # each side sums at most k products |gate| <= 1 times |out| <= max, each rounding within max * eps
    atol = 2 * k * float(out.abs().max()) * torch.finfo(torch.float32).eps
    assert torch.allclose(gating._sparse_decode(out, slots, gates, S), expected, rtol=0, atol=atol)


def test_topk_drop_policy_position_keeps_token_order() -> None:
    lg = logits(8)
    r = gating.route_topk(lg, 3, 0.5, 1, drop_policy="position")
    choices = [sorted(torch.topk(lg.softmax(1)[s], 3).indices.tolist()) for s in range(S)]
    for e in range(E):  # per expert, the first `capacity` tokens routed to it in token order
        routed = [s for s in range(S) if e in choices[s]]
        got = [s for s in routed if r.kept[s, r.experts[s].tolist().index(e)]]
        assert got == routed[:r.capacity]
    with pytest.raises(ValueError, match="drop_policy"):
        gating.route_topk(lg, 3, 0.5, 1, drop_policy="random")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_dropping_equals_the_dropless_path(k: int) -> None:
    torch.manual_seed(0)
    a = MoE(8, torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)), num_experts=4,
            k=k, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    b = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=k, drop_tokens=False, use_rts=False,
            top2_2nd_expert_sampling=False, dropless=True)
    b.deepspeed_moe.experts = a.deepspeed_moe.experts
    b.deepspeed_moe.gate.load_state_dict(a.deepspeed_moe.gate.state_dict())
    x = torch.randn(5, 7, 8)
    (ya, la, ca), (yb, lb, cb) = a(x), b(x)
    bound = 4 * 2.0 ** -24 * float(ya.detach().abs().max()) * 16  # a row's expert matmul of 16 terms, two orders
    assert float((ya - yb).detach().abs().max()) <= bound and torch.equal(la, lb) and torch.equal(ca, cb)


def test_residual_moe_mixes_the_dense_mlp_with_a_learned_coefficient() -> None:
    torch.manual_seed(0)
    dense = torch.nn.Linear(8, 8)
    layer = MoE(8, dense, num_experts=2, use_residual=True, min_capacity=16)
    x = torch.randn(16, 8)
    out, _, _ = layer(x)
    moe_out = layer.deepspeed_moe(x)
    coef = torch.softmax(layer.coefficient(x), -1)
    assert torch.allclose(out, moe_out * coef[:, :1] + dense(x) * coef[:, 1:])


def test_expert_params_get_their_own_optimizer_groups() -> None:
    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, use_residual=True)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(layer.parameters()), "lr": 0.1})
    assert [g.get("moe", False) for g in groups] == [False, True]
    assert all(not is_moe_param(p) for p in groups[0]["params"])
    assert all(is_moe_param(p) and p.group_name == "ep_size_1" for p in groups[1]["params"])
    assert groups[1]["name"] == "ep_size_1" and groups[1]["lr"] == 0.1
    assert len(groups[1]["params"]) == 8  # 4 experts x (weight, bias)


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="use_tutel"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=2, use_tutel=True)
    with pytest.raises(ValueError, match="enable_expert_tensor_parallelism"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match="divisible"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=3, ep_size=2)


def test_signature_is_deepspeeds() -> None:
    import inspect

    import dsrun as deepspeed

    params = inspect.signature(deepspeed.moe.layer.MoE.__init__).parameters
    documented = [("hidden_size", None), ("expert", None), ("num_experts", 1), ("ep_size", 1), ("k", 1),
                  ("capacity_factor", 1.0), ("eval_capacity_factor", 1.0), ("min_capacity", 4),
                  ("use_residual", False), ("noisy_gate_policy", None), ("drop_tokens", True), ("use_rts", True),
                  ("use_tutel", False), ("enable_expert_tensor_parallelism", False),
                  ("top2_2nd_expert_sampling", True)]
    positional = [p for p in params.values() if p.kind == p.POSITIONAL_OR_KEYWORD][1:]
    assert [(p.name, None if p.default is p.empty else p.default) for p in positional] == documented
    assert params["dropless"].kind == params["dropless"].KEYWORD_ONLY  # dsrun's own, after DeepSpeed's
