"""Muon's pieces in one process: DeepSpeed's parameter split, the Newton-Schulz arithmetic, the groups the
engine builds from ``optimizer.params``, the unbound optimizer, and the config's rules (docs/muon.md). The ZeRO
stages against a reference: tests/integration/test_muon_zero.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dsrun.config import load_ds_config
from dsrun.optim import build_optimizer, check_zero_optimizer
from dsrun.optim.muon import (MuonWithAuxAdam, adam_update, muon_param_groups, muon_update, newton_schulz,
                              set_optimizer_flags, zeropower_via_gram_newtonschulz, zeropower_via_newtonschulz5)
from dsrun.utils.errors import ConfigError


@pytest.fixture
def float64_newton_schulz(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(newton_schulz, "NEWTON_SCHULZ_DTYPE", torch.float64)


class Names(nn.Module):
    """Parameters named as in Llama-style and GPT-2-style models."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.wte = nn.Embedding(10, 4)  # GPT-2's name: an embedding DeepSpeed's keywords miss
        self.proj = nn.Linear(4, 6)
        self.conv = nn.Conv2d(2, 3, 3)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 10, bias=False)


def deepspeed_rule(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's ``set_optimizer_flags``, verbatim."""
    return p.ndim >= 2 and not any(keyword in name.lower() for keyword in ("embed", "lm_head"))


def test_parameter_split_is_deepspeeds_rule_plus_embedding_tables() -> None:
    model = Names()
    set_optimizer_flags(model)
    flags = {n: p.use_muon for n, p in model.named_parameters()}
    assert flags == {n: deepspeed_rule(n, p) and n != "wte.weight" for n, p in model.named_parameters()}
    assert [n for n, on in flags.items() if on] == ["proj.weight", "conv.weight"]
    assert deepspeed_rule("wte.weight", model.wte.weight)  # the one difference, documented in docs/muon.md


def test_gram_iteration_is_the_standard_polynomial(float64_newton_schulz: None) -> None:
    torch.manual_seed(0)
    for shape in [(6, 20), (20, 6), (8, 8)]:
        G = torch.randn(*shape, dtype=torch.float64)
        standard, gram = zeropower_via_newtonschulz5(G), zeropower_via_gram_newtonschulz(G)
        assert standard.shape == G.shape
        torch.testing.assert_close(gram, standard, rtol=1e-10, atol=1e-12)
        # the iteration keeps G's singular vectors: in their basis the result is diagonal
        u, _, vh = torch.linalg.svd(G, full_matrices=False)
        in_basis = u.mT @ standard @ vh.mT
        torch.testing.assert_close(in_basis, torch.diag(torch.diagonal(in_basis)), rtol=0, atol=1e-8)
        if shape[0] != shape[1]:  # well conditioned: five steps bring every singular value into (0.5, 1.5)
            s = torch.linalg.svdvals(standard)
            assert 0.5 < float(s.min()) and float(s.max()) < 1.5


def test_momentum_nesterov_and_shape_scale(float64_newton_schulz: None) -> None:
    torch.manual_seed(0)
    g, m = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    expected_m = 0.9 * m + 0.1 * g
    direction = 0.1 * g + 0.9 * expected_m
    update = muon_update(g.clone(), m, beta=0.9, ns_method="standard")
    torch.testing.assert_close(m, expected_m)
    torch.testing.assert_close(update, zeropower_via_newtonschulz5(direction) * 2.0)  # sqrt(12 / 3)


def test_the_default_dtypes_are_deepspeeds_on_the_cpu() -> None:
    # bf16 (standard) and fp16 (gram) where supported, which the CPU accelerator says they are
    assert newton_schulz.newton_schulz_dtype("standard") == torch.bfloat16
    assert newton_schulz.newton_schulz_dtype("gram") == torch.float16
    assert zeropower_via_gram_newtonschulz(torch.randn(4, 9)).dtype == torch.float16


def _marked(*shapes: tuple[int, ...], muon: bool) -> list[nn.Parameter]:
    out = []
    for shape in shapes:
        p = nn.Parameter(torch.randn(*shape))
        p.use_muon = muon
        out.append(p)
    return out


def test_groups_take_deepspeeds_keys_and_overrides() -> None:
    hidden, rest = _marked((3, 4), (5, 4), muon=True), _marked((4,), muon=False)
    frozen = _marked((2, 2), muon=True)[0]
    frozen.requires_grad_(False)
    groups = muon_param_groups([*hidden, frozen, {"params": rest}], {"lr": 0.1, "muon_lr": 0.03, "momentum": 0.9,
                                                                     "betas": (0.8, 0.9), "weight_decay": 0.01})
    assert [g["name"] for g in groups] == ["muon-params", "adam-params"]
    assert groups[0] == {"params": hidden, "use_muon": True, "name": "muon-params", "lr": 0.03, "momentum": 0.9,
                         "weight_decay": 0.01}
    assert groups[1] == {"params": rest, "use_muon": False, "name": "adam-params", "lr": 0.1, "betas": (0.8, 0.9),
                         "weight_decay": 0.01}
    opt = build_optimizer("Muon", [*hidden, *rest], {"adam_lr": 1e-3})
    assert isinstance(opt, MuonWithAuxAdam) and not isinstance(opt, torch.optim.Muon)
    assert [g["params"] for g in opt.param_groups] == [[hidden[1], hidden[0]], rest]  # Muon's: largest first
    assert [g["lr"] for g in opt.param_groups] == [0.02, 1e-3]  # DeepSpeed's defaults where not given
    assert (opt.param_groups[0]["ns_method"], opt.param_groups[1]["eps"]) == ("gram", 1e-10)
    check_zero_optimizer(opt, 2, allow_untested=False)  # one of ZeRO's optimizers, as in DeepSpeed
    with pytest.raises(ConfigError, match="nesterov"):  # DeepSpeed would drop it silently
        build_optimizer("muon", hidden, {"nesterov": False})
    with pytest.raises(ValueError, match="use_muon"):
        muon_param_groups([nn.Parameter(torch.zeros(2))], {})


def test_unbound_step_is_single_device_muon_with_aux_adam(float64_newton_schulz: None) -> None:
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(4, 6, dtype=torch.float64)), nn.Parameter(torch.randn(4, dtype=torch.float64))
    w0, b0 = w.detach().clone(), b.detach().clone()
    opt = MuonWithAuxAdam([{"params": [w], "use_muon": True, "lr": 0.1, "weight_decay": 0.5},
                           {"params": [b], "use_muon": False, "lr": 0.01, "weight_decay": 0.5}])
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    gw, gb = w.grad.clone(), b.grad.clone()
    opt.step()
    expected_w = w0 * (1 - 0.05) - 0.1 * muon_update(gw, torch.zeros_like(gw), beta=0.95, ns_method="gram")
    expected_b = b0 * (1 - 0.005) - 0.01 * adam_update(gb, torch.zeros_like(gb), torch.zeros_like(gb), 1,
                                                      (0.9, 0.95), 1e-10)
    torch.testing.assert_close(w.detach(), expected_w)
    torch.testing.assert_close(b.detach(), expected_b)


def test_config_names_muon_keys_and_offload_rules() -> None:
    base = {"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-4,
                                                                        "ns_method": "standard"}}}
    assert load_ds_config(base).optimizer.name == "muon"
    for params, key in (({"nesterov": True}, "optimizer.params.nesterov"),
                        ({"ns_method": "svd"}, "optimizer.params.ns_method")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_ds_config({**base, "optimizer": {"type": "Muon", "params": params}})
    cpu = {**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert load_ds_config(cpu).zero_optimization.offload_optimizer.device == "cpu"  # DeepSpeed offloads Muon
    nvme = {**base, "gradient_clipping": 0, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
        "save_muon_momentum_buffer_in_memory": True}}  # ZeRO-Infinity with Muon (tests/integration/test_muon_zero.py)
    assert load_ds_config(nvme).zero_optimization.save_muon_momentum_buffer_in_memory
    nvme["zero_optimization"]["offload_optimizer"]["super_offload"] = True  # steps before the updates exist
    with pytest.raises(ConfigError, match=r"offload_optimizer\.super_offload: steps sub-groups during backward, "
                                          "before Muon's whole-matrix updates exist"):
        load_ds_config(nvme)
