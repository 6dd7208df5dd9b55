"""MoE inside the engine and the built-in GPT, in a one-rank world (expert parallelism: tests/integration)."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.moe import groups as expert_groups
from dsrun.models.moe_gpt import MoEGPT, MoEMLP
from dsrun.moe.layer import MoE
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")
NANO = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 4)
        self.moe = MoE(4, torch.nn.Linear(4, 4), num_experts=2, k=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(self.inp(x))
        return out.pow(2).mean() + 0.01 * l_aux


def _config(**extra) -> dict:
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **extra}


@pytest.fixture(autouse=True)
def _fresh_groups():
    expert_groups._reset()
    yield
    expert_groups._reset()


def test_config_optimizer_gets_separate_expert_groups_and_trains() -> None:
    engine, optimizer, _, _ = dsrun.initialize(model=Net(), config=_config())
    assert [bool(g.get("moe")) for g in optimizer.param_groups] == [False, True]
    assert optimizer.param_groups[1]["name"] == "ep_size_1"
    before = engine.module.moe.deepspeed_moe.experts.deepspeed_experts[0].weight.detach().clone()
    loss = engine(torch.randn(4, 4))
    engine.backward(loss)
    engine.step()
    assert not torch.equal(before, engine.module.moe.deepspeed_moe.experts.deepspeed_experts[0].weight)
    engine.destroy()


@pytest.mark.parametrize("breakdown", [True, False])
def test_wall_clock_breakdown_times_the_moe_layers_for_print_forward_breakdown(breakdown, capsys) -> None:
    """DeepSpeed's engine.moe_layers / gate_modules are the MOELayer and TopKGate modules; with
    wall_clock_breakdown each times its last forward (ms), which print_forward_breakdown reports. With one expert
    rank there is no all-to-all to time."""
    engine, _, _, _ = dsrun.initialize(model=Net(), config=_config(wall_clock_breakdown=breakdown))
    layer = engine.module.moe.deepspeed_moe
    assert list(engine.moe_layers) == [layer] and list(engine.gate_modules) == [layer.gate]
    engine(torch.randn(4, 4))
    if breakdown:
        assert layer.time_moe >= layer.gate.gate_time > 0.0  # the gate runs inside the layer
    else:
        assert layer.time_moe == layer.gate.gate_time == 0.0
    assert layer.time_falltoall == layer.time_salltoall == 0.0
    engine.print_forward_breakdown(12.5)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (f"[dsrun] time (ms) | fwd: 12.50 (fwd_moe: {layer.time_moe:.2f}, 1st_a2a: 0.00, 2nd_a2a: 0.00, "
                    f"top_k: {layer.gate.gate_time:.2f})")
    engine.destroy()


def test_a_client_optimizer_mixing_experts_and_shared_params_is_refused() -> None:
    model = Net()
    with pytest.raises(ConfigError, match="split_params_into_different_moe_groups_for_optimizer"):
        dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config={"train_batch_size": 4})


def test_use_data_before_expert_parallelism_sets_the_expert_layout() -> None:
    engine, _, _, _ = dsrun.initialize(model=Net(), config=_config(use_data_before_expert_parallelism=True))
    assert engine.groups.expert_data_first is True  # the layout itself: tests/unit/comm/test_topology.py
    engine.destroy()
    engine, _, _, _ = dsrun.initialize(model=Net(), config=_config())
    assert engine.groups.expert_data_first is False
    engine.destroy()


def test_offloading_an_moe_model_to_nvme_is_refused(tmp_path) -> None:
    for section in ("offload_optimizer", "offload_param"):
        cfg = _config(zero_optimization={"stage": 3, section: {"device": "nvme", "nvme_path": str(tmp_path)}})
        with pytest.raises(ConfigError, match=f"zero_optimization.{section}.device: MoE layers with ZeRO state "
                                              "offloaded to NVMe"):
            dsrun.initialize(model=Net(), config=cfg)


def test_moe_gpt_layers_counts_and_aux_loss() -> None:
    torch.manual_seed(0)
    model = MoEGPT(moe={"num_experts": [2, 4], "k": 2, "every": 2, "loss_coeff": 0.0}, **NANO)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert [m.num_experts for m in layers] == [2, 4]  # blocks 1 and 3, a pyramid
    assert isinstance(model.transformer["h"][0].mlp, torch.nn.Module) and not any(
        isinstance(m, MoE) for m in model.transformer["h"][0].modules())
    total, active = model.moe_parameter_counts()
    expert = 2 * 16 * 64 + 64 + 16  # c_fc + c_proj with biases
    dense_total = sum(p.numel() for p in model.parameters()) - 6 * expert
    assert total == dense_total + 6 * expert and active == dense_total + 2 * 2 * expert
    idx = torch.randint(0, 64, (2, 16))
    model.eval()  # no sampling in the gates: both forwards route alike
    plain = model(idx, idx)
    model.moe_options = type(model.moe_options)(**{**model.moe_options.__dict__, "loss_coeff": 1.0})
    with_aux = model(idx, idx)
    aux = sum(float(m.l_aux.detach()) for m in model.modules() if isinstance(m, MoEMLP))
    assert float((with_aux - plain).detach()) == pytest.approx(aux, rel=1e-5)
    with pytest.raises(ConfigError, match="model.moe.experts"):
        MoEGPT(moe={"experts": 8}, **NANO)
    with pytest.raises(ConfigError, match="num_experts"):
        MoEGPT(moe={"num_experts": [2, 2, 2], "every": 2}, **NANO)


def test_experts_that_ep_size_does_not_divide_are_a_config_error_naming_the_key() -> None:
    """Found by the model's options (so on the meta device, before launch), not by a rank's MoE layer."""
    from dsrun.models.moe_gpt import MoEOptions

    with pytest.raises(ConfigError, match=r"model.moe.num_experts: 3 experts cannot be spread evenly over "
                                          r"model.moe.ep_size=2 ranks"):
        MoEOptions(num_experts=3, ep_size=2).experts_per_layer(4)
    with pytest.raises(ConfigError, match="model.moe.num_experts: 6 experts"):
        MoEOptions(num_experts=[4, 6], ep_size=4).experts_per_layer(2)
    assert MoEOptions(num_experts=[4, 8], ep_size=4).experts_per_layer(2) == [4, 8]
    with pytest.raises(ValueError, match="MoE num_experts: 3 must be divisible by ep_size=2"):  # DeepSpeed's class
        MoE(16, torch.nn.Linear(16, 16), num_experts=3, ep_size=2)


def test_estimator_and_flops_profiler_report_all_and_active_parameters() -> None:
    from dsrun.estimate.counting import count_parameters
    from dsrun.profiling.flops_profiler import FlopsProfiler

    model = MoEGPT(moe={"num_experts": 4, "k": 1}, **NANO)
    total, active = model.moe_parameter_counts()
    counts = count_parameters(model)
    assert (counts.moe_total, counts.moe_active) == (total, active) and active < total == counts.total
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randint(0, 64, (1, 16)))
    lines = "\n".join(prof.summary_lines())
    prof.end_profile()
    from dsrun.profiling.flops_profiler import params_to_string

    assert "MoE params active per token (k experts per layer):" in lines
    assert params_to_string(active) in lines and params_to_string(total) in lines


def test_muon_on_a_moe_model_is_refused_before_the_first_step() -> None:
    """dsrun's Muon is proved on dense matrices only: expert parameters (each expert-parallel rank's own, whose
    updates and clip norm would have to be combined across those ranks) are refused, not trained unproved."""
    muon = {"train_batch_size": 4, "optimizer": {"type": "Muon", "params": {"lr": 0.01}}}
    with pytest.raises(ConfigError, match=r"^optimizer.type: is Muon, but the model has MoE expert parameters"):
        dsrun.initialize(model=Net(), config=muon)
