"""DeepSpeed's whole engine surface on dsrun's engine (one-rank world): the probe of every public name of
DeepSpeed 0.14's ``DeepSpeedEngine`` against the documented exclusions, and the behaviour of the methods
beyond the training loop (batch-size changes, ``no_sync``, ``was_step_applied``, module state dicts, the
config getters). Multi-rank behaviour (reductions, ``safe_get_*``) is in tests/integration/test_safe_get.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import dsrun
from dsrun.engine.sparse_tensor import SparseTensor

pytestmark = pytest.mark.usefixtures("world_of_one")
HERE = Path(__file__).resolve().parent
DOC = HERE.parents[2] / "docs" / "engine.md"


def _names() -> list[str]:
    lines = (HERE / "deepspeed_engine_names.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _exclusions() -> dict[str, str]:
    """The table under 'DeepSpeed engine methods and attributes dsrun leaves out': name -> why."""
    section = DOC.read_text().split("### DeepSpeed engine methods and attributes dsrun leaves out", 1)[1]
    out: dict[str, str] = {}
    for line in section.splitlines()[2:]:
        if not line.startswith("|"):
            if out:
                break
            continue
        first, why = [c.strip() for c in line.strip("|").split("|", 1)]
        if first in ("name", "---"):
            continue
        for name in re.findall(r"`([A-Za-z_]\w*)`", first):
            out[name] = why.strip(" |")
    return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _engine(**extra):
    config = {"train_batch_size": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    return dsrun.initialize(model=_model(), config=config)[0]


def _micro(engine, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 4, generator=gen), torch.randn(2, 1, generator=gen)
    return torch.nn.functional.mse_loss(engine(x), y)


def test_every_deepspeed_engine_name_is_there_or_excluded_with_a_reason() -> None:
    engine = _engine()
    names, excluded = _names(), _exclusions()
    assert len(names) > 200 and "no_sync" in names and "set_train_batch_size" in names
    missing = [n for n in names if not hasattr(engine, n) and n not in excluded]
    assert missing == [], f"DeepSpeed engine names neither implemented nor excluded in docs/engine.md: {missing}"
    stale = [n for n in excluded if hasattr(engine, n)]
    assert stale == [], f"excluded in docs/engine.md but implemented: {stale}"
    for name, why in excluded.items():  # each exclusion says why (or refers to one that does)
        ref = re.fullmatch(r"as `(\w+)`.*", why)
        assert (ref and ref.group(1) in excluded) or len(why) > 30, (name, why)
    assert len(excluded) <= 0.15 * len(names)  # the exclusions are few


def test_set_train_batch_size_changes_the_accumulation_steps() -> None:
    engine = _engine()
    assert engine.get_batch_info() == (4, 2, 2)
    engine.set_train_batch_size(8)
    assert engine.get_batch_info() == (8, 2, 4)
    steps = []
    for i in range(8):  # two optimizer steps of four micro-steps each
        engine.backward(_micro(engine, i))
        engine.step()
        steps.append(engine.was_step_applied())
    assert steps == [False, False, False, True] * 2 and engine.global_steps == 2 and engine.global_samples == 16
    with pytest.raises(ValueError, match="multiple"):
        engine.set_train_batch_size(7)
    engine.set_train_micro_batch_size(1)
    assert engine.get_batch_info() == (4, 1, 4)


def test_no_sync_accumulates_unscaled_and_refuses_step_and_partitioned_gradients() -> None:
    engine = _engine()
    ref = _engine()
    with engine.no_sync():
        engine.backward(_micro(engine, 0))
        with pytest.raises(AssertionError, match="no_sync"):
            engine.step()
        with pytest.raises(AssertionError, match="reentry"):
            with engine.no_sync():
                pass
    ref.backward(_micro(ref, 0))
    # inside no_sync the loss is not divided by the accumulation steps (DeepSpeed's rule): twice the gradient
    for p, q in zip(engine.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=1e-6, atol=0)
    with pytest.raises(AssertionError, match="ZeRO stage 2"):
        with _engine(zero_optimization={"stage": 2}, zero_allow_untested_optimizer=True).no_sync():
            pass


def test_enable_backward_allreduce_off_defers_to_allreduce_gradients() -> None:
    engine, ref = _engine(gradient_clipping=0.0), _engine(gradient_clipping=0.0)  # clipping would undo the 2x
    engine.enable_backward_allreduce = False
    for i in range(2):
        for e in (engine, ref):
            e.backward(_micro(e, i))
            if i == 1 and e is engine:
                engine.allreduce_gradients()
            e.step()
    assert engine.was_step_applied() and ref.was_step_applied()
    # without reduction the loss is not scaled by 1/gas, so each step moved by gas x the reference's gradient
    base = _engine()
    for p, q, b in zip(engine.module.parameters(), ref.module.parameters(), base.module.parameters()):
        torch.testing.assert_close(p.detach() - b.detach(), 2 * (q.detach() - b.detach()), rtol=1e-5, atol=1e-7)


def test_module_state_dict_and_load_module_state_dict_with_a_custom_loader() -> None:
    engine = _engine()
    engine.module[0].bias.requires_grad_(False)
    assert "0.bias" not in engine.module_state_dict(exclude_frozen_parameters=True)
    target = {k: torch.full_like(v, 0.5) for k, v in engine.module_state_dict().items()}
    calls = []

    def loader(src, dst):
        calls.append(sorted(src))
        dst.load_state_dict(src)

    engine.load_module_state_dict({"module": target}, custom_load_fn=loader)
    assert calls == [sorted(target)]
    assert all(bool((p == 0.5).all()) for p in engine.module.parameters())
    # the fp32 masters followed: a step with a zero gradient leaves the loaded value
    from dsrun.utils import safe_get_full_fp32_param

    torch.testing.assert_close(safe_get_full_fp32_param(engine.module[2].weight), target["2.weight"])


def test_config_getters_read_the_config() -> None:
    engine = _engine(fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
                     zero_optimization={"stage": 1, "reduce_bucket_size": 1234},
                     gradient_clipping=0.5, prescale_gradients=True, zero_allow_untested_optimizer=True)
    assert engine.zero_optimization() and engine.zero_optimization_stage() == 1
    assert not engine.zero_optimization_partition_gradients() and engine.zero_reduce_bucket_size() == 1234
    assert engine.fp16_enabled() and not engine.bfloat16_enabled() and not engine.amp_enabled()
    assert engine.loss_scale() == 0 and engine.dynamic_loss_scale() and engine.initial_dynamic_scale() == 256
    assert engine.gradient_clipping() == 0.5 and not engine.postscale_gradients()
    assert engine.zero_offload_optimizer() is None and engine.zero_offload_param() is None
    assert engine.get_data_parallel_world_size() == 1 and engine.get_data_parallel_rank() == 0
    assert engine.optimizer_name() == "SGD" and engine.sequence_parallel_size == 1
    engine.communication_data_type = "fp32"
    assert engine.communication_data_type is torch.float32 and engine.strategy.comm_dtype is torch.float32


def test_sparse_tensor_round_trip() -> None:
    dense = torch.zeros(5, 3)
    dense[1], dense[4] = 1.0, torch.tensor([0.0, 2.0, 3.0])
    sparse = SparseTensor(dense)
    assert sparse.indices.tolist() == [1, 4] and torch.equal(sparse.to_dense(), dense)
    assert sparse.sparse_size() == (2 + 6, 15)
    coo = SparseTensor(dense.to_sparse())
    assert coo.is_sparse and torch.equal(coo.to_coo_tensor().to_dense(), dense)
    rows = SparseTensor(dense.to_sparse(1))  # an embedding's gradient: row-sparse
    assert rows.indices.tolist() == [1, 4] and torch.equal(rows.to_dense(), dense)


def test_tiled_linear_computes_the_linear_layer() -> None:
    from dsrun.zero import TiledLinear, TiledLinearReturnBias
    from dsrun.zero.tiling import partition_uniform

    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    torch.manual_seed(3)
    linear = torch.nn.Linear(10, 7).double()
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, init_linear=linear).double()
    assert len(tiled.linears) == 2 and len(tiled.linears[0]) == 3
    assert sum(m.bias is not None for row in tiled.linears for m in row) == 2  # the last input split's tiles
    x = torch.randn(4, 10, dtype=torch.float64)
    torch.testing.assert_close(tiled(x), linear(x), rtol=1e-12, atol=1e-12)
    outs = TiledLinear(10, 7, out_splits=2, combine_out_splits=False, init_linear=linear).double()(x)
    torch.testing.assert_close(torch.cat(outs, dim=-1), linear(x), rtol=1e-12, atol=1e-12)

    class ReturnsBias(torch.nn.Linear):
        def forward(self, x):  # Megatron's style: the bias is returned, not added
            return torch.nn.functional.linear(x, self.weight), self.bias

    rb = TiledLinearReturnBias(10, 7, in_splits=2, out_splits=2, linear_cls=ReturnsBias, init_linear=linear).double()
    out, bias = rb(x)
    torch.testing.assert_close(out + bias, linear(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="in splits"):
        TiledLinear(3, 2, in_splits=4)


def test_the_compile_sections_backend_and_kwargs_reach_torch_compile(monkeypatch) -> None:
    seen = []
    original = torch.nn.Module.compile

    def recording(module, *args, **kwargs):
        seen.append(kwargs)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", recording)
    _engine(compile={"enabled": True, "backend": "eager", "kwargs": {"fullgraph": True, "dynamic": False}})
    _engine(compile={"enabled": False, "backend": "eager", "kwargs": {"fullgraph": True}})
    assert seen == [{"backend": "eager", "fullgraph": True, "dynamic": False}]


def test_the_compile_section_compiles_the_module() -> None:
    plain = _engine()
    compiled = _engine(compile={"enabled": True, "backend": "eager"})
    assert compiled.is_compiled and not plain.is_compiled
    assert compiled.module._compiled_call_impl is not None and plain.module._compiled_call_impl is None
    x = torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), plain(x), rtol=0, atol=0)  # the eager backend runs the same ops
    compiled.compile(backend="inductor")  # a second call does nothing, as in DeepSpeed
    assert compiled.module._compiled_call_impl is not None
