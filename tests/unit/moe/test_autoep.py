"""AutoEP (dsrun/autoep): config, routing, weight repacking, the replacement layer against the block it
replaces, detection, the rank layout with AutoTP, and the engine's ``expert_parallel`` section on one rank.
(Expert parallelism across ranks against one rank holding every expert: tests/integration/test_moe_parity.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.autoep import layer as autoep_layer
from dsrun.autoep.config import AutoEPConfig, parse_autoep_config, validate_autoep_config, \
    validate_autoep_post_detection
from dsrun.autoep.detect import AutoEP
from dsrun.autoep.folding import build_folding_spec, expected_folding_group_tables
from dsrun.autoep.layer import AutoEPMoELayer, compute_split_plan
from dsrun.autoep.repack import classify_fused_gate_up_layout, repack_expert_weights
from dsrun.autoep.router import TokenChoiceTopKRouter
from dsrun.utils.errors import ConfigError

H, FFN, E, K = 8, 12, 4, 2
U = 2.0 ** -24


class Experts(nn.Module):  # Transformers >= 5's fused expert storage
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * FFN, H) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, H, FFN) * 0.3)


class Block(nn.Module):
    """A Mixtral-style MoE block, computed expert by expert: the reference the AutoEP layer replaces."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = Experts()

    def forward(self, x):
        flat = x.reshape(-1, H)
        scores = torch.softmax(self.gate(flat), dim=-1)
        top, idx = torch.topk(scores, K, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            gate, up = (flat[tok] @ self.experts.gate_up_proj[e].T).chunk(2, dim=-1)
            out.index_add_(0, tok, (F.silu(gate) * up) @ self.experts.down_proj[e].T * top[tok, slot, None])
        return out.reshape(x.shape)


class Config:
    model_type = "mixtral"
    num_local_experts = E
    num_experts_per_tok = K


class Model(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.config = Config()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(layers))
        for layer in self.model.layers:
            layer.mlp = Block()
        self.head = nn.Linear(H, 1)

    def forward(self, x):
        for layer in self.model.layers:
            x = x + layer.mlp(x)
        return self.head(x).pow(2).mean()


def _replace(model: nn.Module, **overrides) -> list:
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True, "use_grouped_mm": False} | overrides))
    specs = auto_ep.ep_parser()
    auto_ep.replace_moe_layers(specs, ep_size=1, ep_rank=0)
    return specs


@pytest.mark.parametrize("grouped_mm", [False, True])
def test_layer_matches_the_block_it_replaces_forward_and_backward(grouped_mm: bool) -> None:
    model = Model(layers=1)
    reference = Model(layers=1)
    specs = _replace(model, use_grouped_mm=grouped_mm)  # True: torch._grouped_mm, False: a loop over experts
    assert [s.moe_module_name for s in specs] == ["model.layers.0.mlp"] and specs[0].model_family == "mixtral"
    assert (specs[0].hidden_size, specs[0].ffn_hidden_size, specs[0].num_experts, specs[0].top_k) == (H, FFN, E, K)
    layer = model.model.layers[0].mlp
    assert isinstance(layer, AutoEPMoELayer)
    x = torch.randn(3, 5, H)
    got, want = model(x), reference(x)
    got.backward()
    want.backward()
    # the same fp32 terms summed in another order: each output sums K experts' FFN-long dot products
    assert abs(got.item() - want.item()) <= 4 * FFN * K * U * max(1.0, abs(want.item()))
    ref = reference.model.layers[0].mlp
    torch.testing.assert_close(layer.router.gate.weight.grad, ref.gate.weight.grad, rtol=1e-4, atol=1e-6)
    gate_up_grad = torch.cat((layer.experts.w1.grad, layer.experts.w3.grad), dim=1)
    torch.testing.assert_close(gate_up_grad, ref.experts.gate_up_proj.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(layer.experts.w2.grad, ref.experts.down_proj.grad, rtol=1e-4, atol=1e-6)
    # expert weights carry DeepSpeed's MoE marks (reduced over their expert-data-parallel group)
    assert all(not p.allreduce and p.group_name == "ep_size_1" for p in layer.experts.parameters())


def test_router_top_k_normalisation_scale_and_group_limit() -> None:
    router = TokenChoiceTopKRouter(2, 4, None, None, 2, "softmax", True, 2.5, False)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0], [0, 1], [2, 0], [0, 0.5]]))
    scores, experts, counts = router(torch.tensor([[1.0, 0.0]]))
    assert sorted(experts[0].tolist()) == [0, 2]
    assert abs(scores.sum().item() - 2.5) <= 1e-6  # normalised to 1, then scaled
    assert counts.tolist() == [1, 0, 1, 0] and counts.dtype == torch.int32
    # two groups {0,1} {2,3}, one allowed: the group scored by its best two experts wins
    grouped = TokenChoiceTopKRouter(2, 4, 2, 1, 2, "softmax", False, 1.0, False)
    grouped.load_state_dict(router.state_dict())
    x = torch.tensor([[0.0, 3.0]])  # logits [0, 3, 0, 1.5]: the best two are 1 and 3, the best pair is {0, 1}
    assert set(router(x)[1][0].tolist()) == {1, 3}
    assert set(grouped(x)[1][0].tolist()) == {0, 1}


def test_split_plan_is_one_exchange_of_the_count_matrix(monkeypatch) -> None:
    # two EP ranks, two local experts each; this is rank 1 and rank 0 routed [1, 2, 3, 0] to the global experts
    sent = []

    def exchange(output, input_, group=None):
        sent.append(input_.clone())
        output.copy_(torch.tensor([3, 0, 4, 5], dtype=torch.int32))  # rows: from rank 0, from rank 1 (itself)

    monkeypatch.setattr(autoep_layer.dist, "all_to_all_single", exchange)
    selected = torch.tensor([[0, 2], [3, 3], [3, 3], [2, 2], [2, 3]])  # histogram [1, 0, 4, 5]
    plan = compute_split_plan(selected, num_experts=4, ep_size=2, num_local_experts=2, ep_group=None)
    assert len(sent) == 1 and sent[0].tolist() == [1, 0, 4, 5]
    assert plan.input_splits == [1, 9] and plan.output_splits == [3, 9]
    assert plan.local_counts.tolist() == [7, 5] and plan.local_counts_by_source.tolist() == [[3, 0], [4, 5]]


def test_repack_reads_both_fused_layouts_and_module_lists_alike() -> None:
    block = Block()
    spec = _replace(Model(layers=1))[0]
    w1, w2, w3 = repack_expert_weights(block.experts, spec, ep_rank=1, ep_size=2)  # experts 2 and 3
    torch.testing.assert_close(torch.cat((w1, w3), 1), block.experts.gate_up_proj.data[2:])
    torch.testing.assert_close(w2, block.experts.down_proj.data[2:])
    assert classify_fused_gate_up_layout((E, 2 * FFN, H), (E, H, FFN)).layout == "gate_up_first"
    hidden_first = classify_fused_gate_up_layout((E, H, 2 * FFN), (E, FFN, H))
    assert (hidden_first.layout, hidden_first.hidden_size, hidden_first.ffn_hidden_size) == ("hidden_first", H, FFN)
    assert classify_fused_gate_up_layout((E, H, H), (E, H, H)) is None
    block.experts.gate_up_proj = nn.Parameter(block.experts.gate_up_proj.data.transpose(1, 2).contiguous())
    block.experts.down_proj = nn.Parameter(block.experts.down_proj.data.transpose(1, 2).contiguous())
    v1, v2, v3 = repack_expert_weights(block.experts, spec, ep_rank=1, ep_size=2)
    assert torch.equal(v1, w1) and torch.equal(v2, w2) and torch.equal(v3, w3)


def test_config_refusals() -> None:
    with pytest.raises(ValueError, match="load_balance_coeff=0.01 is not supported"):
        parse_autoep_config({"enabled": True, "load_balance_coeff": 0.01})
    with pytest.raises(ValueError, match="must divide the stage size"):
        validate_autoep_config(AutoEPConfig(enabled=True, autoep_size=3), world_size=8, pp_size=1, tp_size=1,
                               sp_size=1)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 is reserved"):
        validate_autoep_config(AutoEPConfig(enabled=True, autoep_size=2, expert_tensor_parallel_size=2),
                               world_size=4, pp_size=1, tp_size=1, sp_size=1)
    spec = _replace(Model(layers=1))[0]
    with pytest.raises(ValueError, match="Valid autoep_size values"):
        validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=8), [spec])
    from dsrun.autoep.feature import AutoEPFeature
    from dsrun.config import load_ds_config

    cfg = load_ds_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, "autoep_sise": 2}})
    with pytest.raises(ConfigError, match="expert_parallel.autoep_sise.*autoep_size"):
        AutoEPFeature.build(cfg)


def test_folding_layout_with_autotp() -> None:
    spec = build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4)
    assert (spec.dp_size, spec.edp_size) == (4, 2)
    tables = expected_folding_group_tables(spec)
    assert tables.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert tables.ep_groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and tables.edp_groups[0] == (0, 4)


def test_folded_checkpoint_record_is_written_and_checked_field_by_field() -> None:
    """``checkpoint.autoep_universal``'s folding record: what it writes, and a resume under another layout refused
    naming the field (the sizes always, the rest when the caller names them)."""
    from dsrun.checkpoint.autoep_universal import make_folding_metadata, validate_folding_metadata

    record = make_folding_metadata(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, zero_partition_group="edp",
                                   zero_partition_rank=0, zero_partition_count=2, family="routed_expert",
                                   param_families={"w1": {"family": "routed_expert"}})
    assert (record["etp_size"], record["dispatch_strategy"], record["shared_expert_placement"]) == (
        1, "route_full_partition_dispatch", "tp_sharded")
    state = {"folding": record}
    assert validate_folding_metadata(state, tp_size=2, ep_size=4, tp_rank=1, family="routed_expert") is record
    with pytest.raises(RuntimeError, match="mismatch for ep_size: saved=4 runtime=2"):
        validate_folding_metadata(state, tp_size=2, ep_size=2)
    with pytest.raises(RuntimeError, match="mismatch for zero_partition_group: saved=edp runtime=dense_dp"):
        validate_folding_metadata(state, tp_size=2, ep_size=4, zero_partition_group="dense_dp")
    with pytest.raises(RuntimeError, match="Missing AutoEP\\+AutoTP folding metadata"):
        validate_folding_metadata({}, tp_size=2, ep_size=4)
    with pytest.raises(RuntimeError, match="Unsupported folding metadata version: 7"):
        validate_folding_metadata({"folding": {**record, "version": 7}}, tp_size=2, ep_size=4)


@pytest.mark.parametrize("data_first,order", [(False, [0, 2, 1, 3]), (True, [0, 1, 2, 3])])
def test_deepspeeds_autoep_checkpoints_consolidate_into_the_universal_layout(tmp_path, data_first, order) -> None:
    """``checkpoint.autoep_universal``'s readers of DeepSpeed's AutoEP files: ZeRO-1/2 fragments of 4 data-parallel
    ranks (EP 2) gathered per expert-parallel rank in DeepSpeed's rank layout (ranks 0, 2 hold EP rank 0's experts;
    data-first: ranks 0, 1), one file per expert stacked per weight, Adam moments of the expert-parallel ranks' files
    concatenated; a missing fragment, inconsistent steps and AutoTP-cut (folded) expert shards refused."""
    from dsrun.checkpoint.autoep_universal import (_zero12_fragment_path, consolidate_autoep_expert_files,
                                                   consolidate_autoep_optimizer_states,
                                                   consolidate_autoep_zero12_expert_states,
                                                   get_autoep_zero12_expert_param_info, make_folding_metadata)

    tmp, out, name = str(tmp_path / "tmp"), str(tmp_path / "universal"), "model.layers.0.mlp.experts.w1"
    (tmp_path / "tmp" / name / "0").mkdir(parents=True)
    for state, base in (("fp32", 0), ("exp_avg", 10), ("exp_avg_sq", 20)):
        for rank in range(4):
            torch.save(torch.tensor([base + rank], dtype=torch.float32), _zero12_fragment_path(tmp, name, state, rank))
    for rank in range(4):
        torch.save(torch.tensor(7), _zero12_fragment_path(tmp, name, "step", rank))
    info = get_autoep_zero12_expert_param_info([{"expert_key_prefix": "model.layers.0.mlp.experts", "num_experts": 4,
                                                  "num_local_experts": 2, "ep_size": 2}])
    assert sorted(info) == [f"model.layers.0.mlp.experts.{w}" for w in ("w1", "w2", "w3")]
    consolidate_autoep_zero12_expert_states(tmp, out, {name: info[name]}, {name: (2, 1)}, 4, 1, data_first)
    for state, base in (("fp32", 0), ("exp_avg", 10), ("exp_avg_sq", 20)):
        saved = torch.load(tmp_path / "universal" / "zero" / name / f"{state}.pt", weights_only=False)
        assert saved["param"].view(-1).tolist() == [float(base + r) for r in order]
        assert (saved["cat_dim"], saved["is_expert_param"], saved["ep_num_experts"]) == (0, True, 4)
    assert int(torch.load(tmp_path / "universal" / "zero" / name / "step.pt", weights_only=False)) == 7
    torch.save(torch.tensor(8), _zero12_fragment_path(tmp, name, "step", 3))
    with pytest.raises(RuntimeError, match="Inconsistent AutoEP optimizer steps"):
        consolidate_autoep_zero12_expert_states(tmp, out, {name: info[name]}, {name: (2, 1)}, 4, 1, data_first)
    (tmp_path / "tmp" / name / "0" / f"fp32.{order[1]:02d}").unlink()  # half of EP rank 0's slice
    with pytest.raises(RuntimeError, match="fp32 fragment size mismatch .* EP rank 0: got 1, expected 2"):
        consolidate_autoep_zero12_expert_states(tmp, out, {name: info[name]}, {name: (2, 1)}, 4, 1, data_first)
    (tmp_path / "tmp" / name / "0" / f"fp32.{order[0]:02d}").unlink()
    with pytest.raises(RuntimeError, match="Missing AutoEP fp32 fragments"):
        consolidate_autoep_zero12_expert_states(tmp, out, {name: info[name]}, {name: (2, 1)}, 4, 1, data_first)

    if data_first:
        return  # the per-expert files once
    ckpt, layers = tmp_path / "ckpt", [{"moe_layer_id": 0, "num_experts": 2, "num_local_experts": 1,
                                        "expert_key_prefix": "experts"}]
    ckpt.mkdir()
    for e in range(2):
        torch.save({f"experts.{w}.{e}": torch.full((2, 3), 10.0 * e + i) for i, w in enumerate(("w1", "w2", "w3"))},
                   ckpt / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
        torch.save({"optimizer": {"state": {0: {"exp_avg": torch.full((1, 2, 3), float(e)),
                                                "exp_avg_sq": torch.full((1, 2, 3), e + 0.5)}},
                                  "param_groups": [{"params": [0], "param_names": ["experts.w2"]}]}},
                   ckpt / f"expp_rank_{e}_mp_rank_00_optim_states.pt")
    consolidate_autoep_expert_files(str(ckpt), out, layers)
    consolidate_autoep_optimizer_states(str(ckpt), out, layers, ep_size=2)
    w2 = torch.load(tmp_path / "universal" / "zero" / "experts.w2" / "fp32.pt", weights_only=False)["param"]
    assert w2.shape == (2, 2, 3) and w2[:, 0, 0].tolist() == [1.0, 11.0]
    avg = torch.load(tmp_path / "universal" / "zero" / "experts.w2" / "exp_avg.pt", weights_only=False)["param"]
    assert avg.shape == (2, 2, 3) and avg[:, 0, 0].tolist() == [0.0, 1.0]
    for tp_rank in range(2):  # the same expert cut over 2 TP lanes: only a folded runtime reads it
        torch.save({"folding": make_folding_metadata(tp_size=2, tp_rank=tp_rank, ep_size=2, ep_rank=0,
                                                     zero_partition_group="edp", zero_partition_rank=0,
                                                     zero_partition_count=1, family="routed_expert")},
                   ckpt / f"layer_0_expert_0_mp_rank_0{tp_rank}_model_states.pt")
    with pytest.raises(NotImplementedError, match="folded AutoEP\\+AutoTP expert shards"):
        consolidate_autoep_expert_files(str(ckpt), out, layers)


def test_folded_dispatch_partitions_each_experts_assignments_over_the_tp_lanes() -> None:
    """``moe.ep_tp_dispatch`` on one process: ordinals restart per expert; over 2 TP lanes each active assignment
    lands on exactly one, an expert's rows alternating, the all-to-all splits recounted per lane; dropped and
    padding rows go nowhere; the restore at one lane is the weighted per-token sum, and a lost row is caught."""
    from dsrun.autoep.ep_tp_dispatch import (RoutedAssignmentPayload, assignment_ordinals_by_expert,
                                             dispatch_counters, partition_assignments, restore_combined)

    experts = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    assert assignment_ordinals_by_expert(experts).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    payload = RoutedAssignmentPayload(
        token_indices=torch.tensor([0, 1, 2, 0, 3, 1, 2, 3, 4]), expert_indices=experts,
        assignment_indices=assignment_ordinals_by_expert(experts), capacity_slots=torch.arange(9),
        combine_weights=torch.linspace(0.1, 0.9, 9), drop_mask=torch.zeros(9, dtype=torch.bool),
        pad_mask=torch.zeros(9, dtype=torch.bool), input_splits=[3, 2, 4], output_splits=[3, 2, 4],
        extra={"destination_ranks": experts, "num_tokens": torch.tensor(5)})
    lanes = [partition_assignments(payload, tp_group=None, tp_rank=r, tp_size=2) for r in range(2)]
    assert [lane.input_splits for lane, _ in lanes] == [[2, 1, 2], [1, 1, 2]]
    rows = [set(ctx.local_indices.tolist()) for _, ctx in lanes]
    assert rows[0].isdisjoint(rows[1]) and rows[0] | rows[1] == set(range(9))
    payload.drop_mask[1], payload.pad_mask[6] = True, True
    local, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    assert dispatch_counters(ctx) == {"assignments_total": 7, "assignments_local": 7, "padded": 1, "dropped": 1,
                                      "split_sum_in": 7, "split_sum_out": 7}
    values = torch.randn(7, 3)
    expected = torch.zeros(5, 3).index_add(0, local.token_indices, values * local.combine_weights[:, None])
    torch.testing.assert_close(restore_combined(values, ctx, tp_group=None), expected, rtol=1e-6, atol=1e-6)
    ctx.local_indices = ctx.local_indices[:-1]
    with pytest.raises(RuntimeError, match="restore coverage mismatch: 6 assignments gathered, 7 routed"):
        restore_combined(values[:-1], ctx, tp_group=None, validate_coverage=True)


def test_engine_replaces_blocks_and_trains(world_of_one, tmp_path) -> None:
    import dsrun

    model = Model()
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": "mixtral", "use_grouped_mm": False}}
    engine, _, _, _ = dsrun.initialize(model=model, config=cfg)
    layers = [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
    assert len(layers) == 2 and engine.has_moe_layers
    before = layers[0].experts.w1.detach().clone()
    x = torch.randn(2, 3, H)
    losses = []
    for _ in range(3):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and not torch.equal(before, layers[0].experts.w1)
    # DeepSpeed's DeepSpeedConfig reads the section as AutoEP does; a checkpoint written by DeepSpeed's AutoEP
    # folded over AutoTP is refused at load, naming why (dsrun does not fold AutoEP over AutoTP)
    from dsrun.config.deepspeed_config import DeepSpeedConfig

    assert DeepSpeedConfig(cfg).expert_parallel_config.autoep_size == 1
    with pytest.raises(ValueError, match="load_balance_coeff=0.02 is not supported.*null or omit"):
        DeepSpeedConfig({**cfg, "expert_parallel": {**cfg["expert_parallel"], "load_balance_coeff": 0.02}})
    engine.save_checkpoint(str(tmp_path), tag="t")
    states = tmp_path / "t" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    torch.save({**saved, "folding": {"version": 1, "tp_size": 2, "ep_size": 2}}, states)
    with pytest.raises(RuntimeError, match="Folded AutoEP\\+AutoTP checkpoint requires a folded runtime"):
        engine.load_checkpoint(str(tmp_path), tag="t")
    engine.destroy()


class _Layer(nn.Module):
    """A block that calls its MoE layer (a region ``compile.autoep_non_moe`` compiles)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.mlp = Block()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _LayeredModel(Model):
    def __init__(self):
        super().__init__()
        self.model.layers = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def test_autoep_non_moe_compiles_the_blocks_and_keeps_the_moe_layers_eager(world_of_one) -> None:
    import dsrun
    from dsrun.utils.errors import ConfigError

    def train(**compile_section) -> tuple[object, list[float]]:
        torch.manual_seed(1)
        model = _LayeredModel()
        cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": "mixtral",
                                   "use_grouped_mm": False}, "compile": compile_section}
        engine, *_ = dsrun.initialize(model=model, config=cfg)
        if compile_section:
            engine.compile(backend="eager")
        x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(2))
        losses = []
        for _ in range(2):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return engine, losses

    eager_engine, eager = train()
    eager_engine.destroy()
    engine, compiled = train(autoep_non_moe=True)
    layers = engine.module.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)  # the blocks are compiled regions
    assert all(getattr(layer.mlp.forward, "_torchdynamo_disable", False) for layer in layers)  # the MoE eager
    assert compiled == pytest.approx(eager, rel=1e-6)  # the same ops (the eager backend), one graph per region
    engine.destroy()
    with pytest.raises(ConfigError, match="compile.autoep_non_moe.*compile.deepcompile"):
        train(autoep_non_moe=True, deepcompile=True)
