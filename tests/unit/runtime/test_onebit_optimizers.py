"""The 1-bit optimizers' arithmetic and schedules on one process (no compression happens with one rank, as in
DeepSpeed), against float64 references of their formulas; and their parameter checks. The compressed
exchange itself is tested in tests/unit/comm/test_compressed.py and, in the engine, tests/integration/
test_onebit.py."""
from __future__ import annotations

import pytest
import torch

from dsrun.optim import Lamb
from dsrun.optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam, build_onebit_optimizer
from dsrun.utils.errors import ConfigError

# a handful of fp32 roundings per step, a few steps: far inside this relative bound (fp32 eps is 6e-8)
RTOL, ATOL = 1e-5, 1e-7


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) * (1 + i) for i, p in enumerate(params)]


def _adam_reference(steps: int, freeze: int, lr: float, wd: float, bias_correction: bool, eps_inside: bool,
                    betas=(0.9, 0.999), eps=1e-8) -> list[torch.Tensor]:
    """1-bit Adam on one rank in float64: Adam, then the variance frozen after ``freeze`` steps."""
    params = [p.detach().double() for p in _params()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        t = step + 1
        for p, g, mi, vi in zip(params, _grads(step, params), m, v):
            g = g.double()
            mi.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            if t <= freeze:
                vi.mul_(betas[1]).add_(g * g, alpha=1 - betas[1])
            b1 = 1 - betas[0] ** t if bias_correction else 1.0
            b2 = 1 - betas[1] ** min(t, freeze) if bias_correction else 1.0
            denom = (vi / b2 + eps).sqrt() if eps_inside else (vi / b2).sqrt() + eps
            p.sub_(lr * (mi / b1 / denom + wd * p))
    return params


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    for step in range(steps):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("bias_correction, eps_inside", [(True, False), (False, False), (True, True)])
def test_onebit_adam_is_adam_then_freezes_the_variance(bias_correction: bool, eps_inside: bool) -> None:
    params = _params()
    opt = OnebitAdam(params, lr=1e-2, freeze_step=3, weight_decay=0.1, bias_correction=bias_correction,
                     eps_inside_sqrt=eps_inside)
    _run(opt, params, 3)
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    for step in range(3, 7):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v) for p, v in zip(params, frozen))
    for got, want in zip(params, _adam_reference(7, 3, 1e-2, 0.1, bias_correction, eps_inside)):
        torch.testing.assert_close(got.detach().double(), want, rtol=RTOL, atol=ATOL)


def test_onebit_adam_warmup_matches_torch_adamw() -> None:
    params, twins = _params(), _params()
    _run(OnebitAdam(params, lr=1e-2, freeze_step=5, weight_decay=0.1), params, 5)
    _run(torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1), twins, 5)
    for got, want in zip(params, twins):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_zero_one_adam_variance_and_local_step_schedules() -> None:
    params = _params()
    opt = ZeroOneAdam(params, lr=1e-2, var_freeze_step=12, var_update_scaler=2, local_step_scaler=3,
                      local_step_clipper=4)
    reduced, synced = [], []
    for step in range(24):
        reduced.append(opt.reduce_next_step())
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
        state = opt.state[params[0]]
        synced.append(state.get("synced_param") is not None and state["lrs"] == 0.0)
    # variance (and a full all-reduce) at steps 1, 2 (interval -> 2), 4, 6 (-> 4), 8, 12 (-> 8); none after 12
    assert [t + 1 for t, r in enumerate(reduced) if r] == [1, 2, 4, 6, 8, 12]
    # local steps from 13: interval 1 for 3 steps, 2 for 3, then 4 (the clipper) for good
    assert [t + 1 for t, s in enumerate(synced) if s] == [13, 14, 15, 16, 18, 20, 24]
    state = opt.state[params[0]]
    assert state["variance_updates"] == 6 and state["local_step_interval"] == 4
    assert torch.equal(params[0].detach(), state["synced_param"])  # step 24 synchronised


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_zero_one_adam_without_its_savings_is_onebit_adam(weight_decay: float) -> None:
    """Variance updated at every step until the freeze and a synchronisation after every local step: 0/1
    Adam is then 1-bit Adam's algorithm, weight decay included (DeepSpeed's 0/1 Adam folds the decay into the
    momentum at each synchronisation, which makes it act about 1 / (1 - beta1) times as strongly)."""
    params, twins = _params(), _params()
    _run(ZeroOneAdam(params, lr=1e-2, var_freeze_step=4, var_update_scaler=4, local_step_scaler=10**6,
                     weight_decay=weight_decay), params, 12)
    _run(OnebitAdam(twins, lr=1e-2, freeze_step=4, weight_decay=weight_decay), twins, 12)
    for got, want in zip(params, twins):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_onebit_lamb_warmup_is_layerwise_lamb_and_freezes_the_coefficients() -> None:
    params, twins = _params(), _params()
    opt = OnebitLamb(params, lr=1e-2, freeze_step=10, weight_decay=0.01, max_coeff=2.0, min_coeff=0.05,
                     coeff_beta=0.5)
    lamb = Lamb(twins, lr=1e-2, weight_decay=0.01, max_coeff=2.0, min_coeff=0.05)
    frozen = [0.0, 0.0]
    for step in range(10):
        for group in ((params, opt), (twins, lamb)):
            for p, g in zip(group[0], _grads(step, group[0])):
                p.grad = g
            group[1].step()
        coeffs = opt.get_lamb_coeffs()
        assert all(0.05 <= c <= 2.0 for c in coeffs)
        frozen = [0.5 * f + 0.5 * c if c != 1.0 else f for f, c in zip(frozen, coeffs)]
    for got, want in zip(params, twins):  # each tensor its own trust ratio, as dsrun's Lamb per tensor
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert [opt.coeffs[f"0.{i}"]["lamb_coeff_freeze"] for i in range(2)] == pytest.approx(frozen, rel=1e-12)


def test_onebit_lamb_factor_rules_in_the_compressed_phase() -> None:
    params = _params()
    opt = OnebitLamb(params, lr=1e-2, freeze_step=10, factor_max=1.3, factor_min=0.9, factor_threshold=0.02)
    _run(opt, params, 10)
    frozen = [opt.coeffs[f"0.{i}"]["lamb_coeff_freeze"] for i in range(2)]
    last = [1.0, 1.0]
    for step in range(10, 30):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
        factors = [c / f for c, f in zip(opt.get_lamb_coeffs(), frozen)]
        for factor, previous in zip(factors, last):
            assert 0.9 - 1e-12 <= factor <= 1.3 + 1e-12
            assert abs(factor / previous - 1) <= 0.02 + 1e-12  # factor_threshold per step
        last = factors
    assert any(abs(f - 1.0) > 0.05 for f in last)  # the factor did move, within its bounds


def test_the_compressed_phase_keeps_masked_momentum_exactly_zero() -> None:
    params = _params()
    mask = torch.ones(6, 5)
    mask[0] = 0.0
    opt = OnebitAdam([{"params": [params[0]], "exp_avg_mask": mask}, {"params": [params[1]]}], lr=1e-2, freeze_step=2)
    _run(opt, params, 6)
    assert torch.count_nonzero(opt.state[params[0]]["exp_avg"][0]) == 0
    assert torch.count_nonzero(opt.state[params[0]]["exp_avg"][1:]) == 5 * 5


@pytest.mark.parametrize("cls, kwargs, key", [
    (OnebitAdam, {"amsgrad": True}, "optimizer.params.amsgrad"),
    (OnebitAdam, {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
    (OnebitAdam, {"freeze_step": 0}, "optimizer.params.freeze_step"),
    (OnebitAdam, {"comm_backend_name": "gloo"}, "optimizer.params.comm_backend_name"),
    (ZeroOneAdam, {"local_step_clipper": 0}, "optimizer.params.local_step_clipper"),
    (OnebitLamb, {"freeze_step": 5}, "optimizer.params.coeff_beta"),  # 1 / (1 - 0.9) = 10 > 5
    (OnebitLamb, {"factor_min": 2.0, "factor_max": 1.0}, "optimizer.params.factor_min"),
])
def test_bad_params_are_config_errors_naming_the_key(cls, kwargs, key) -> None:
    with pytest.raises(ConfigError) as err:
        cls(_params(), **kwargs)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)



@pytest.mark.parametrize("params", [{"freeze_step": 2}, {"freeze_step": 2, "coeff_beta": 0.9}, {"min_coeff": 20.0},
                                    {"factor_max": 0.25}, {"freeze_step": 10, "coeff_beta": 0.5, "max_coeff": 2.0}])
def test_validate_and_the_constructor_apply_one_set_of_rules(params) -> None:
    """``dsrun config --validate`` (load_ds_config) refuses exactly what OnebitLamb's constructor refuses, with the
    same problems, a missing param counting as its default; the defaults they use are the constructor's."""
    import inspect

    from dsrun.config import load_ds_config
    from dsrun.config.optim import ONE_BIT_LAMB_DEFAULTS

    signature = inspect.signature(OnebitLamb).parameters
    assert {key: signature[key].default for key in ONE_BIT_LAMB_DEFAULTS} == ONE_BIT_LAMB_DEFAULTS
    try:
        load_ds_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "OneBitLamb", "params": params}},
                       world_size=1)
        validated = []
    except ConfigError as err:
        validated = [str(p) for p in err.problems]
    try:
        OnebitLamb(_params(), **params)
        constructed = []
    except ConfigError as err:
        constructed = [str(p) for p in err.problems]
    assert [p.replace(" by default", "") for p in validated] == constructed  # (validate says which were defaults)
    assert bool(validated) == (params.get("coeff_beta") != 0.5)

def test_unknown_params_and_names() -> None:
    with pytest.raises(ConfigError, match="ZeroOneAdam rejected the params .*freeze_step"):
        build_onebit_optimizer("ZeroOneAdam", _params(), {"freeze_step": 10})  # 0/1 Adam's is var_freeze_step
    assert type(build_onebit_optimizer("onebitlamb", _params(), {"comm_backend_name": "mpi"})) is OnebitLamb


def test_cuda_aware_has_no_effect_and_says_so(capsys: pytest.CaptureFixture) -> None:
    OnebitAdam(_params(), cuda_aware=True)
    assert "cuda_aware has no effect in dsrun" in capsys.readouterr().out
    OnebitAdam(_params(), cuda_aware=False)
    assert capsys.readouterr().out == ""


def test_unbound_on_several_ranks_refuses_to_step(monkeypatch: pytest.MonkeyPatch) -> None:
    params = _params()
    opt = OnebitAdam(params)
    monkeypatch.setattr(OnebitAdam, "world_size", property(lambda self: 2))
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    with pytest.raises(RuntimeError, match="pass it to dsrun.initialize"):
        opt.step()


def test_the_pipeline_engine_refuses_them(world_of_one) -> None:
    import torch.nn.functional as F

    import dsrun
    from dsrun.pipe import PipelineModule

    module = PipelineModule(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), num_stages=1,
                            loss_fn=F.mse_loss)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2}}}
    with pytest.raises(ConfigError, match="optimizer.type: OnebitAdam does not run under the pipeline engine"):
        dsrun.initialize(model=module, config=config)
