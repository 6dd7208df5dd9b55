"""Optimizers by DeepSpeed name, the torch implementations, and ZeRO's untested-optimizer rule."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from dsrun.optim import Adam, Lamb, Lion, build_optimizer, check_zero_optimizer, compiled_cpu_adam
from dsrun.utils.errors import ConfigError


def _params(n: int = 4) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n))]


@pytest.fixture(autouse=True)
def no_compiled_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin the torch path; the compiled-op preference has its own test."""
    monkeypatch.setattr("dsrun.optim.registry.compiled_cpu_adam", lambda: None)


@pytest.mark.parametrize("name,cls", [("Adam", torch.optim.AdamW), ("adamw", torch.optim.AdamW),
                                      ("LAMB", Lamb), ("lion", Lion), ("Adagrad", torch.optim.Adagrad),
                                      ("SGD", torch.optim.SGD), ("sgd", torch.optim.SGD),
                                      ("RMSprop", torch.optim.RMSprop)])
def test_names_are_case_insensitive(name: str, cls: type) -> None:
    assert type(build_optimizer(name, _params(), {"lr": 0.01})) is cls


def test_adam_modes_follow_deepspeed() -> None:
    # DeepSpeed's "Adam" decays AdamW-style unless adam_w_mode is false (then L2, i.e. torch's Adam)
    assert type(build_optimizer("Adam", _params(), {"adam_w_mode": False})) is torch.optim.Adam
    assert build_optimizer("AdamW", _params(), {}).defaults["weight_decay"] == 0.0
    assert type(build_optimizer("Adam", _params(), {"bias_correction": False})) is Adam
    assert type(build_optimizer("Adam", _params(), {"torch_adam": True})) is torch.optim.AdamW
    # weight decay left out: 0 where dsrun stands in for DeepSpeed's FusedAdam / CPU Adam (their default), torch's
    # 0.01 with torch_adam, where DeepSpeed builds torch.optim.AdamW itself
    assert build_optimizer("AdamW", _params(), {"torch_adam": True}).defaults["weight_decay"] == 0.01
    assert build_optimizer("Adam", _params(), {"torch_adam": True}).defaults["weight_decay"] == 0.01


def test_unknown_and_unbuildable_names_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="did you mean 'AdamW'|AdamW"):
        build_optimizer("AdamX", _params(), {})
    with pytest.raises(ConfigError, match="the mup package's optimizers"):  # not a CUDA matter
        build_optimizer("MuAdam", _params(), {})
    # the 1-bit family communicates by itself: the engine builds it (dsrun.optim.onebit)
    with pytest.raises(ConfigError, match="OneBitAdam communicates by itself and is built by dsrun.initialize"):
        build_optimizer("OneBitAdam", _params(), {})
    with pytest.raises(ConfigError, match="optimizer.params"):
        build_optimizer("Lion", _params(), {"momentum": 0.9})


def test_compiled_cpu_adam_is_used_on_cpu_whatever_the_build_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    class DeepSpeedCPUAdam(torch.optim.AdamW):
        OP_NAME = "test_fake_adam"

        def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                     amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
            self.adamw_mode = adamw_mode
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    fake = types.ModuleType("dsrun.ops.adam")
    fake.DeepSpeedCPUAdam = DeepSpeedCPUAdam
    monkeypatch.setitem(sys.modules, "dsrun.ops.adam", fake)
    monkeypatch.setattr("dsrun.optim.registry.compiled_cpu_adam", compiled_cpu_adam)  # the real probe
    assert compiled_cpu_adam() is DeepSpeedCPUAdam
    opt = build_optimizer("Adam", _params(), {"lr": 0.1, "adam_w_mode": False})
    assert type(opt) is DeepSpeedCPUAdam and opt.adamw_mode is False
    assert type(build_optimizer("Adam", _params(), {"torch_adam": True})) is torch.optim.AdamW
    assert type(build_optimizer("Adam", _params(), {}, on_cpu=False)) is torch.optim.AdamW
    fake.is_compiled = lambda: False  # not in the build cache yet: still the same class (it builds on first use)
    assert compiled_cpu_adam() is DeepSpeedCPUAdam


def test_no_ops_package_means_torch_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dsrun.ops.adam", None)  # import fails
    assert compiled_cpu_adam() is None
    assert type(build_optimizer("AdamW", _params(), {})) is torch.optim.AdamW


def _train(opt_factory, steps: int = 5) -> torch.Tensor:
    p = _params(6)
    opt = opt_factory(p)
    for step in range(steps):
        p[0].grad = torch.sin(torch.arange(6.0) + step)
        opt.step()
    return p[0].detach()


def test_dsrun_adam_matches_torch() -> None:
    for w_mode, ref in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        ours = _train(lambda p: Adam(p, lr=0.01, weight_decay=0.1, adam_w_mode=w_mode))
        theirs = _train(lambda p: ref(p, lr=0.01, weight_decay=0.1))
        torch.testing.assert_close(ours, theirs)


def test_lion_is_sign_momentum_with_decoupled_decay() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    p.grad = torch.tensor([0.3, -0.1])
    opt.step()
    # m = 0 first: update = sign(0.1 * g); p = p * (1 - lr * wd) - lr * sign
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1]))
    torch.testing.assert_close(opt.state[p]["exp_avg"], 0.01 * torch.tensor([0.3, -0.1]))


def test_lamb_trust_ratio_is_clipped() -> None:
    p = torch.nn.Parameter(torch.full((4,), 100.0))
    opt = Lamb([p], lr=0.01, max_coeff=10.0)
    p.grad = torch.ones(4)
    opt.step()
    # first Adam update is ~1 per element (norm 2); ||w||/||u|| = 100 is clipped to 10
    torch.testing.assert_close(p.detach(), torch.full((4,), 100.0 - 0.01 * 10.0), rtol=1e-5, atol=1e-5)


def test_zero_untested_optimizer_rule() -> None:
    sgd = torch.optim.SGD(_params(), lr=0.1)
    check_zero_optimizer(sgd, 0, allow_untested=False)  # no ZeRO: anything goes
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        check_zero_optimizer(sgd, 1, allow_untested=False)
    check_zero_optimizer(sgd, 2, allow_untested=True)
    for opt in (torch.optim.AdamW(_params()), Lamb(_params()), Lion(_params()), torch.optim.Adagrad(_params())):
        check_zero_optimizer(opt, 2, allow_untested=False)
