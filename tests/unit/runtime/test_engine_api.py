"""dsrun.initialize / the engine's public surface, in a one-rank world (multi-rank behaviour is in
tests/integration)."""
from __future__ import annotations

import argparse
import inspect
import json

import pytest
import torch

import dsrun
from dsrun.optim.lr_schedules import WarmupLR
from dsrun.utils.errors import ConfigError

pytestmark = pytest.mark.usefixtures("world_of_one")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _config(**extra) -> dict:
    return {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **extra}


def _batch(n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.randn(n, 1)


def _train_step(engine) -> torch.Tensor:
    x, y = _batch(engine.train_micro_batch_size_per_gpu())
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss


def test_signatures_match_deepspeed() -> None:
    assert list(inspect.signature(dsrun.initialize).parameters) == [
        "args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port",
        "mpu", "dist_init_required", "collate_fn", "config", "mesh_param", "config_params"]
    params = inspect.signature(dsrun.init_distributed).parameters
    assert list(params)[:3] == ["dist_backend", "auto_mpi_discovery", "distributed_port"]
    # None: DeepSpeed's default_pg_timeout, DEEPSPEED_TIMEOUT minutes (10 unset), read when the world is made
    assert params["timeout"].default is None
    backward = inspect.signature(dsrun.initialize(model=_model(), config=_config())[0].backward).parameters
    assert list(backward) == ["loss", "allreduce_gradients", "release_loss", "retain_graph", "scale_wrt_gas"]


def test_no_model_is_refused_as_deepspeed_refuses_it() -> None:
    """No model: a ConfigError naming the argument, and the AssertionError DeepSpeed raises; passing the model
    positionally (DeepSpeed's first parameter is ``args``) says so."""
    with pytest.raises(AssertionError, match="a model is required") as no_model:
        dsrun.initialize(model=None, config=_config())
    assert isinstance(no_model.value, ConfigError) and "args" not in str(no_model.value)
    with pytest.raises(ConfigError, match="first positional argument is args"):
        dsrun.initialize(_model(), config=_config())


def test_config_getters_called_unbound_read_a_stand_ins_config() -> None:
    """DeepSpeed's getters read ``self._config``: called on the class with a stand-in holding only that, they
    answer from it (DeepSpeed's own tests do so)."""
    import types

    stand_in = types.SimpleNamespace(_config=types.SimpleNamespace(log_level="ERROR", gradient_clipping=0.5))
    assert dsrun.DeepSpeedEngine.log_level(stand_in) == "ERROR"
    assert dsrun.DeepSpeedEngine.gradient_clipping(stand_in) == 0.5


def test_initialize_returns_engine_optimizer_loader_scheduler() -> None:
    data = torch.utils.data.TensorDataset(*_batch(6))
    engine, optimizer, loader, scheduler = dsrun.initialize(
        model=_model(), config=_config(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}}),
        training_data=data)
    # torch's AdamW, or the compiled DeepSpeedCPUAdam once dsrun.ops is built
    assert optimizer is engine.optimizer and type(optimizer).__name__ in ("AdamW", "DeepSpeedCPUAdam")
    assert isinstance(scheduler, WarmupLR) and scheduler is engine.lr_scheduler
    assert len(loader) == 3 and all(len(x) == 2 for x, _ in loader)
    assert engine.train_batch_size() == 2 and engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 1 and engine.zero_optimization_stage() == 0


def test_client_optimizer_and_scheduler_win_over_config() -> None:
    model = _model()
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, optimizer, _, scheduler = dsrun.initialize(
        model=model, optimizer=client, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
        config=_config(scheduler={"type": "WarmupLR"}))
    assert optimizer is client and isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    _train_step(engine)
    assert engine.get_lr() == [0.25]
    made = dsrun.initialize(model=_model(), optimizer=lambda params: torch.optim.Adagrad(params, lr=0.3),
                            config=_config())[1]
    assert isinstance(made, torch.optim.Adagrad) and made.param_groups[0]["lr"] == 0.3


def test_config_from_args_and_the_conflict_rules(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config()))
    parser = dsrun.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed is True
    engine = dsrun.initialize(args=args, model=_model())[0]
    assert engine.train_batch_size() == 2
    with pytest.raises(ConfigError, match="deepspeed_config"):
        dsrun.initialize(args=args, model=_model(), config=_config())
    with pytest.raises(ConfigError, match="no DeepSpeed config"):
        dsrun.initialize(model=_model())
    assert dsrun.initialize(model=_model(), config_params=_config())[0].train_batch_size() == 2
    with pytest.warns(UserWarning, match="deprecated"):
        old = parser.parse_args(["--deepscale_config", str(path)])
        dsrun.initialize(args=old, model=_model())


def test_gradient_accumulation_boundaries_and_counters() -> None:
    engine, _, _, scheduler = dsrun.initialize(
        model=_model(), config=_config(train_batch_size=6, train_micro_batch_size_per_gpu=2,
                                       scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                                                 "warmup_type": "linear",
                                                                                 "warmup_max_lr": 0.1}}))
    boundaries = []
    for _ in range(7):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        _train_step(engine)
    assert boundaries == [False, False, True, False, False, True, False]
    assert engine.micro_steps == 7 and engine.global_steps == 2 and engine.global_samples == 12
    assert scheduler.last_batch_iteration == 1 and engine.get_lr() == pytest.approx([0.01])
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()


def test_weights_change_only_at_the_boundary() -> None:
    engine = dsrun.initialize(model=_model(), config=_config(train_batch_size=4, train_micro_batch_size_per_gpu=2))[0]
    before = [p.detach().clone() for p in engine.module.parameters()]
    _train_step(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    _train_step(engine)
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_zero_with_an_untested_optimizer_needs_the_flag() -> None:
    cfg = _config(optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero_optimization={"stage": 1})
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        dsrun.initialize(model=_model(), config=cfg)
    engine = dsrun.initialize(model=_model(), config={**cfg, "zero_allow_untested_optimizer": True})[0]
    _train_step(engine)
    assert engine.global_steps == 1


def test_wall_clock_breakdown_times_each_phase(capsys) -> None:
    engine = dsrun.initialize(model=_model(), config=_config(wall_clock_breakdown=True, steps_per_print=2))[0]
    assert engine.wall_clock_breakdown()
    _train_step(engine)
    means = engine.timers.mean_ms()
    assert {"forward", "backward", "backward_inner", "backward_allreduce", "step"} <= set(means)
    assert all(v >= 0 for v in means.values())
    _train_step(engine)
    out = capsys.readouterr().out
    assert "step=2" in out and "forward:" in out and "backward:" in out


def test_step_line_every_steps_per_print_unless_turned_off(capsys) -> None:
    engine = dsrun.initialize(model=_model(), config=_config(steps_per_print=1))[0]
    _train_step(engine)
    assert "[dsrun] step=1, skipped=0, lr=[" in capsys.readouterr().out
    engine.print_step_lines = False  # what the worker does: its own progress line replaces this one
    _train_step(engine)
    assert "step=2" not in capsys.readouterr().out


def test_memory_breakdown_counts_model_state() -> None:
    engine = dsrun.initialize(model=_model(), config=_config())[0]
    _train_step(engine)
    mem = engine.memory_breakdown().as_dict()
    numel = sum(p.numel() for p in engine.module.parameters())
    assert mem["parameters"] == numel * 4 and mem["gradients"] == numel * 4
    assert mem["optimizer_states"] == 2 * numel * 4  # Adam's two moments
    assert mem["total"] == (mem["parameters"] + mem["gradients"] + mem["master_weights"] + mem["optimizer_states"]
                            + mem["buffers"])


def test_bf16_engine_keeps_fp32_master_weights() -> None:
    engine = dsrun.initialize(model=_model(), config=_config(bf16={"enabled": True}, zero_optimization={"stage": 2}))[0]
    assert engine.bfloat16_enabled() and next(engine.module.parameters()).dtype == torch.bfloat16
    x, y = _batch()
    loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
    engine.backward(loss)
    engine.step()
    assert engine.optimizer.param_groups[0]["params"][0].dtype == torch.float32
    assert engine.memory_breakdown().master_weights > 0


def test_stage_3_is_reported_until_it_exists() -> None:
    from dsrun.zero.strategies import STRATEGY_CLASSES, strategy_class

    assert 3 in STRATEGY_CLASSES
    try:
        import dsrun.zero.stage3  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(ConfigError, match="stage 3 is not available"):
            strategy_class(3)


def test_comm_layer_counts_collectives() -> None:
    from dsrun import comm

    comm.reset_comms_stats()
    t = torch.ones(10)
    comm.all_reduce(t)
    comm.all_gather_into_tensor(torch.empty(10), t)
    stats = comm.get_comms_stats()
    assert stats["all_reduce"]["count"] == 1 and stats["all_reduce"]["message_bytes"] == 40
    assert stats["all_reduce"]["traffic_bytes"] == 0  # one rank sends nothing
    assert "all_gather" in comm.log_summary()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_groups_keep_their_own_hyperparameters(stage: int) -> None:
    def groups(model):
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
        return [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.05}]

    model, reference = _model(), _model()
    engine = dsrun.initialize(model=model, model_parameters=groups(model),  # against unclipped torch AdamW
                              config=_config(zero_optimization={"stage": stage}, gradient_clipping=0.0))[0]
    ref_opt = torch.optim.AdamW(groups(reference), lr=0.01)
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.5, 0.0]
    for _ in range(3):
        x, y = _batch()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for a, b in zip(engine.module.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_fp16_auto_cast_casts_float_inputs() -> None:
    engine = dsrun.initialize(model=_model(), config=_config(fp16={"enabled": True, "auto_cast": True,
                                                                   "initial_scale_power": 8}))[0]
    x, y = _batch()
    out = engine(x)  # fp32 input, fp16 model
    assert out.dtype == torch.float16 and engine.fp16_enabled() and engine.cur_scale == 256
    engine.backward(torch.nn.functional.mse_loss(out.float(), y))
    engine.step()
    assert engine.global_steps == 1 and engine.skipped_steps == 0


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 4)  # gets no gradient: its bucket is launched at the end of backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unused_parameters_do_not_stall_or_skew_the_step(stage: int) -> None:
    engine = dsrun.initialize(model=_WithUnused(), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 8},
        "gradient_clipping": 0.0})[0]  # against unclipped torch AdamW
    reference = _WithUnused()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
    unused_before = engine.module.unused.weight.detach().clone()
    for _ in range(3):
        x, y = _batch()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    torch.testing.assert_close(engine.module.used.weight, reference.used.weight)
    assert torch.equal(engine.module.unused.weight, unused_before)  # zero gradient, zero decay: unchanged


SCHEDULES = [("WarmupLR", {}), ("WarmupDecayLR", {"warmup_num_steps": 10, "total_num_steps": 20}),
             ("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 20}),
             ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1}), ("LRRangeTest", {})]


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("kind, params", SCHEDULES, ids=[k for k, _ in SCHEDULES])
def test_optimizer_lr_is_the_schedules_before_the_first_step(kind: str, params: dict, stage: int) -> None:
    """DeepSpeed's TestGetLrBeforeTrain: after initialize the optimizer holds scheduler.get_lr(); a warm-up
    from 0 (WarmupLR's default) makes the first optimizer step move nothing."""
    cfg = _config(scheduler={"type": kind, "params": params}, gradient_clipping=1.0,
                  optimizer={"type": "Adam", "params": {"lr": 0.00015}}, zero_optimization={"stage": stage})
    engine, optimizer, _, scheduler = dsrun.initialize(model=_model(), config=cfg)
    with pytest.warns(UserWarning) if kind.startswith("Warmup") else _quiet():
        true_lrs = scheduler.get_lr()
    assert [g["lr"] for g in optimizer.param_groups] == true_lrs
    if kind == "WarmupLR":
        before = [p.detach().clone() for p in engine.module.parameters()]
        _train_step(engine)
        assert all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))


def _quiet():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_destroy_releases_hooks_and_groups(stage: int) -> None:
    """engine.destroy() (DeepSpeed's name): no autograd or module hook of the engine survives it."""
    model = _model()
    engine, *_ = dsrun.initialize(model=model, config=_config(zero_optimization={"stage": stage}))
    _train_step(engine)
    hooked = lambda: (sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())  # noqa: E731
                      + sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()))
    assert hooked() > 0
    engine.groups.model  # a group of this rank alone, made on first use
    engine.destroy()
    assert hooked() == 0
    assert all(type(m._parameters) is dict for m in model.modules())
    assert engine.groups._axis_groups == {"pipe": None, "data": None, "model": None}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_hooks_run_around_the_update_on_every_stage(stage: int) -> None:
    """The one step path's named hooks (dsrun/zero/step_hooks.py): before_update sees the gradients and
    may change the coefficient (0: the update moves nothing but Adam's state), after_update follows it."""
    model = _model()
    engine, *_ = dsrun.initialize(model=model, config=_config(zero_optimization={"stage": stage},
                                                             optimizer={"type": "SGD", "params": {"lr": 0.1}},
                                                             zero_allow_untested_optimizer=True))
    seen = []

    def before(state) -> None:
        seen.append(("before", state.step, sum(float(g.abs().sum()) for g in state.gradients()) > 0))
        state.coef = 0.0

    handle = engine.strategy.hooks.add("before_update", before)
    engine.strategy.hooks.add("after_update", lambda state: seen.append(("after", state.step, state.coef)))
    gather = dsrun.zero.GatheredParameters(list(model.parameters()))
    with gather:
        start = [p.detach().clone() for p in model.parameters()]
    _train_step(engine)
    with gather:
        assert all(torch.equal(a, p) for a, p in zip(start, model.parameters()))  # plain SGD with coef 0
    handle.remove()
    _train_step(engine)
    with gather:
        assert not all(torch.equal(a, p) for a, p in zip(start, model.parameters()))
    assert seen == [("before", 0, True), ("after", 0, 0.0), ("after", 1, 1.0)]
    with pytest.raises(ValueError, match="before_update"):
        engine.strategy.hooks.add("before_reduce", before)
