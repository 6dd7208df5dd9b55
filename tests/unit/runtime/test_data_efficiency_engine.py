"""The engine's data-efficiency seams in a one-rank world: what reaches the model's forward, PLD's executed
layers, random-LTD's layer-tokens, the refusals, and the curriculum loader from initialize."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dsrun
from dsrun.models.gpt import GPT, pld_keep_probabilities
from dsrun.models.layers import Block
from dsrun.data_efficiency import convert_to_random_ltd
from dsrun.workloads.data_efficiency_run import LayerMeter
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")
SEQ = 32


class Spy(torch.nn.Module):
    """Records the keyword arguments of every forward."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.calls: list[dict] = []

    def forward(self, x, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=None):
        self.calls.append({"curriculum_seqlen": curriculum_seqlen, "progressive_layer_drop": progressive_layer_drop,
                           "pld_theta": pld_theta})
        return self.linear(x).pow(2).mean()


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "steps_per_print": 1000, **extra}


def _steps(engine, n: int, make=lambda: (torch.randn(2, 4),)) -> None:
    for _ in range(n):
        loss = engine(*make())
        engine.backward(loss)
        engine.step()


LEGACY = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 8}}


def test_legacy_curriculum_passes_curriculum_seqlen_at_global_steps_plus_one():
    engine, *_ = dsrun.initialize(model=Spy(), config=_config(curriculum_learning=LEGACY))
    _steps(engine, 30)
    got = [c["curriculum_seqlen"] for c in engine.module.calls]
    expected = [min(64, (v := math.floor((s + 1) / 20 * 56 + 8)) - v % 8) for s in range(30)]
    assert got == expected
    engine.eval()
    engine(torch.randn(2, 4))
    assert engine.module.calls[-1]["curriculum_seqlen"] is None  # eval: the full length


def test_gpt_truncates_to_curriculum_seqlen():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)
    x = torch.randint(0, 32, (2, SEQ + 1))
    assert torch.equal(model(x[:, :-1], x[:, 1:], curriculum_seqlen=8), model(x[:, :8], x[:, 1:9]))


def test_custom_legacy_schedule_from_the_engine():
    config = _config(curriculum_learning={**LEGACY, "schedule_type": "custom", "schedule_config": None})
    engine, *_ = dsrun.initialize(model=Spy(), config=config)
    engine.set_custom_curriculum_learning_schedule(lambda step: min(64, 3 * step))
    _steps(engine, 5)
    assert [c["curriculum_seqlen"] for c in engine.module.calls] == [3, 6, 9, 12, 15]


def test_pld_passes_theta_and_get_pld_theta_follows_the_schedule():
    engine, *_ = dsrun.initialize(model=Spy(), config=_config(
        progressive_layer_drop={"enabled": True, "theta": 0.5, "gamma": 0.01}))
    thetas = []
    for _ in range(40):
        thetas.append(engine.get_pld_theta())
        _steps(engine, 1)
    calls = engine.module.calls
    assert all(c["progressive_layer_drop"] is True for c in calls)
    assert [c["pld_theta"] for c in calls] == thetas
    # θ is updated at each optimizer step with the step counter before it moves: θ(k - 1) during step k
    assert thetas[0] == 1.0 and all(thetas[k] == 0.5 * np.exp(-0.01 * (k - 1)) + 0.5 for k in range(1, 40))


def test_gpt_executes_the_expected_fraction_of_layers():
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=4, n_layer=8, n_head=1, n_embd=8).train()
    meter = LayerMeter(model, model.transformer["h"])
    per_layer = torch.zeros(8)
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: per_layer.__setitem__(i, per_layer[i] + 1))
             for i, b in enumerate(model.transformer["h"])]
    x = torch.randint(0, 16, (1, 4))
    forwards = 1000
    with torch.no_grad():
        for _ in range(forwards):
            model(x, progressive_layer_drop=True, pld_theta=0.5)
    for h in hooks:
        h.remove()
    keep = np.array(pld_keep_probabilities(0.5, 8))
    expected = keep.mean()  # 1 - (L + 1)/(2L)·(1 - θ) = 0.71875
    # the fraction's standard error is sqrt(Σ p(1-p))/(8·1000) = 0.0048, so ±2% is about 3 of them
    assert abs(meter.totals()["layers_executed_fraction"] / expected - 1) <= 0.02
    # each block at its own probability, within 5 standard errors: the first kept most, the last at θ
    stderr = np.sqrt(keep * (1 - keep) / forwards)
    assert np.all(np.abs(per_layer.numpy() / forwards - keep) <= 5 * stderr + 1e-12)


def _pld_reference(model: GPT, x: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """The PLD paper's forward, written out: a skipped block (scale 0) is the identity; a kept one adds both
    residual branches times its scale."""
    h = model.transformer["wte"](x) + model.transformer["wpe"](torch.arange(x.size(1)))
    for block, scale in zip(model.transformer["h"], scales):
        if scale:
            h = h + scale * block.attn(block.ln_1(h))
            h = h + scale * block.mlp(block.ln_2(h))
    return model.lm_head(model.transformer["ln_f"](h))


def test_pld_forward_skips_blocks_as_identity_and_scales_kept_branches_only_while_training():
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=8, n_layer=6, n_head=2, n_embd=8).double()
    x = torch.randint(0, 16, (2, 8))
    keep = pld_keep_probabilities(0.5, 6)
    seen = set()
    with torch.no_grad():
        for seed in range(8):
            torch.manual_seed(seed)
            draws = torch.rand(6).tolist()
            scales = [1.0 / p if u < p else 0.0 for u, p in zip(draws, keep)]
            seen.update(i for i, s in enumerate(scales) if s == 0.0)
            torch.manual_seed(seed)
            got = model.train()(x, progressive_layer_drop=True, pld_theta=0.5)
            # fp64 throughout: the same operations in the same order, so equal to rounding
            torch.testing.assert_close(got, _pld_reference(model, x, scales), rtol=1e-12, atol=1e-12)
        # evaluation runs every block unscaled (the expectation of the scaled training forward), whatever θ says
        full = _pld_reference(model, x, [1.0] * 6)
        torch.testing.assert_close(model.eval()(x, progressive_layer_drop=True, pld_theta=0.5), full,
                                   rtol=1e-12, atol=1e-12)
        # θ = 1 keeps every block unscaled: the training forward is the plain model's
        torch.testing.assert_close(model.train()(x, progressive_layer_drop=True, pld_theta=1.0), full,
                                   rtol=1e-12, atol=1e-12)
    assert seen  # some block was skipped in the draws above


def test_models_without_the_arguments_are_refused_at_initialize():
    plain = torch.nn.Linear(4, 1)
    with pytest.raises(ConfigError, match="progressive_layer_drop"):
        dsrun.initialize(model=plain, config=_config(progressive_layer_drop={"enabled": True, "theta": 0.5}))
    with pytest.raises(ConfigError, match="curriculum_seqlen"):
        dsrun.initialize(model=plain, config=_config(curriculum_learning=LEGACY))


def _ltd(require_steps: int = 10) -> dict:
    return {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
        "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": 8, "max_value": SEQ, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": require_steps, "seq_per_step": 8}}}}}}


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=SEQ, n_layer=4, n_head=2, n_embd=16)


def test_random_ltd_layer_tokens_equal_the_analytic_count():
    engine, *_ = dsrun.initialize(model=_gpt(), config=_config(gradient_accumulation_steps=2, **_ltd()))
    convert_to_random_ltd(engine, Block)
    meter = LayerMeter(engine.module, engine.module.transformer["h"])
    steps = 14
    _steps(engine, steps * 2, make=lambda: (torch.randint(0, 32, (2, SEQ)), torch.randint(0, 32, (2, SEQ))))
    analytic = 0
    for step in range(steps):
        kept = min(SEQ, (v := math.floor(step / 10 * (SEQ - 8) + 8)) - v % 8)
        analytic += 4 * (kept * 2 + SEQ * 2)  # global batch 4: 2 random-LTD layers keep `kept`, 2 see all
    assert meter.totals()["layer_tokens"] == analytic
    assert engine.data_efficiency.random_ltd_scheduler.state["consumed_layer_tokens"] == analytic
    assert analytic < steps * 4 * SEQ * 4  # fewer than the dense model's


def test_random_ltd_without_converted_layers_is_refused():
    engine, *_ = dsrun.initialize(model=_gpt(), config=_config(**_ltd()))
    with pytest.raises(ConfigError, match="convert_to_random_ltd"):
        engine(torch.randint(0, 32, (2, SEQ)), torch.randint(0, 32, (2, SEQ)))


def test_an_enclosing_enabled_false_keeps_the_technique_off(capsys):
    config = _ltd()
    config["data_efficiency"]["data_routing"]["enabled"] = False
    engine, *_ = dsrun.initialize(model=_gpt(), config=_config(**config))
    assert not engine.random_ltd_enabled() and engine.data_efficiency.random_ltd_scheduler is None
    assert "data_efficiency.data_routing.enabled is false" in capsys.readouterr().out


def test_initialize_with_training_data_returns_the_curriculum_loader(tmp_path):
    from dsrun.data_efficiency.data_sampling import CurriculumDataLoader

    data = torch.utils.data.TensorDataset(torch.arange(40).reshape(20, 2))
    config = _config(data_efficiency={"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {
        "enabled": True, "curriculum_metrics": {"seqlen": {
            "difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 1, "max_difficulty": 2,
            "schedule_type": "custom"}}}}})
    engine, _, loader, _ = dsrun.initialize(model=torch.nn.Linear(2, 1), config=config, training_data=data)
    assert isinstance(loader, CurriculumDataLoader) and engine.curriculum_learning_enabled()
    engine.set_custom_curriculum_learning_schedule({"seqlen": lambda step: 1 if step < 3 else 2})
    seen = []
    engine.set_data_post_process_func(lambda batch, state: seen.append(state["current_difficulties"]) or batch)
    for _ in range(4):
        (batch,) = next(loader)
        assert batch.shape == (2, 2)
    assert [s["seqlen"] for s in seen] == [1, 1, 2, 2]
    assert engine.data_efficiency.checkpoint_entries()["data_sampler"]["curriculum_step"] == 4


def test_layer_token_lr_schedule_is_refused():
    config = _ltd()
    config["data_efficiency"]["data_routing"]["random_ltd"]["layer_token_lr_schedule"] = {
        "enabled": True, "total_layer_tokens": 10, "warmup_type": "linear", "warmup_layer_tokens": 1}
    with pytest.raises(ConfigError, match="layer_token_lr_schedule"):
        dsrun.initialize(model=_gpt(), config=_config(**config))
