"""PipelineModule and the pipeline engine on a one-rank world: building, forward, activation checkpointing,
seeds, checkpoint names, and the ``pipeline`` config keys (each acts or is refused)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsrun
from dsrun.pipe import LayerSpec, PipelineModule, PipeDataParallelTopology, TiedLayerSpec
from dsrun.pipe.engine import PipelineEngine, PipelineError
from dsrun.pipe.schedule import TrainSchedule
from dsrun.pipe.timed import GPipeSchedule, ZeroBubbleSchedule
from dsrun.utils import RepeatingLoader
from dsrun.utils.errors import ConfigError, UserError

pytestmark = pytest.mark.usefixtures("world_of_one")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def test_a_sequential_becomes_one_stage_with_stable_names() -> None:
    net = mlp()
    module = PipelineModule(net, num_stages=1)
    assert {n for n, _ in module.named_parameters()} == {f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")}
    x = torch.randn(3, 4)
    torch.testing.assert_close(module(x), net(x), rtol=0, atol=0)
    assert module.topology().get_dim("pipe") == 1 and module.mpu().get_data_parallel_world_size() == 1


def test_specs_build_on_their_stage_and_tied_specs_share_one_module() -> None:
    def head(embed: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, embed.weight)

    module = PipelineModule([TiedLayerSpec("embed", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4),
                             TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=head)], num_stages=1)
    names = [n for n, _ in module.named_parameters()]
    assert names.count("tied_modules.embed.weight") == 1 and "1.weight" in names
    tokens = torch.tensor([[1, 2, 3]])
    expected = F.linear(module.get_submodule("1")(module.tied_modules["embed"](tokens)), module.tied_modules["embed"].weight)
    torch.testing.assert_close(module(tokens), expected, rtol=0, atol=0)
    assert module.tied_comms == {}  # one stage holds both uses: nothing to synchronise
    assert repr(LayerSpec(nn.Linear, 4, 4, bias=False)) == "Linear(4, 4, bias=False)"
    with pytest.raises(RuntimeError, match="torch.nn.Module"):
        LayerSpec(len)


def test_activation_checkpointing_recomputes_chosen_ranges_with_the_same_gradients() -> None:
    calls = []

    def counting(function, *args):
        calls.append(len(args))
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    x = torch.randn(5, 4)
    grads = []
    for interval, layers in ((0, None), (2, None), (2, ["Linear", "Tanh"]), (1, ["Linear"])):
        calls.clear()
        module = PipelineModule(mlp(), num_stages=1, activation_checkpoint_interval=interval,
                                activation_checkpoint_func=counting, checkpointable_layers=layers)
        module(x.clone().requires_grad_(True)).square().sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]))
        assert len(calls) == {0: 0, 2: 3, 1: 3}[interval]  # ranges of 2 over 5 layers; or the 3 Linear layers
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=0, atol=0)


def test_a_range_whose_inputs_carry_no_gradient_is_not_checkpointed() -> None:
    calls = []
    module = PipelineModule([nn.Embedding(10, 4), nn.Linear(4, 4)], num_stages=1, activation_checkpoint_interval=1,
                            activation_checkpoint_func=lambda f, *a: calls.append(1) or f(*a))
    module(torch.tensor([[1, 2]])).sum().backward()
    assert len(calls) == 1 and module.get_submodule("0").weight.grad is not None


def test_seed_layers_builds_the_same_weights_whatever_the_rng() -> None:
    specs = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)]
    built = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        built.append([p.detach().clone() for p in PipelineModule(specs, num_stages=1, seed_layers=True).parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*built))
    torch.manual_seed(1)
    other = [p.detach().clone() for p in PipelineModule(specs, num_stages=1).parameters()]
    torch.manual_seed(2)
    assert not torch.equal(other[0], next(PipelineModule(specs, num_stages=1).parameters()))


def test_checkpoint_names_follow_deepspeed(tmp_path) -> None:
    module = PipelineModule(mlp(), num_stages=1)
    assert module.ckpt_layer_path(str(tmp_path), 2).endswith("layer_02-model_states.pt")
    assert module.ckpt_prefix("ckpt", "global_step3") == "ckpt/global_step3/module-pipe_00"
    assert module.ckpt_layer_path_list(str(tmp_path), 0) == []
    assert module.get_additional_losses() is None


def test_construction_errors_name_the_argument() -> None:
    with pytest.raises(RuntimeError, match="num_stages or topology"):
        PipelineModule(mlp())
    with pytest.raises(UserError, match="do not divide"):
        PipelineModule(mlp(), num_stages=2)
    with pytest.raises(UserError, match="disagrees"):
        PipelineModule(mlp(), num_stages=2, topology=PipeDataParallelTopology(num_pp=1, num_dp=1))


# --- the engine on one rank -----------------------------------------------------------------------------------
def config(**extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}
    cfg.update(extra)
    return cfg


def engine_for(partition_method: str = "parameters", **extra):
    module = PipelineModule(mlp(), num_stages=1, loss_fn=F.mse_loss, partition_method=partition_method)
    engine, _, _, _ = dsrun.initialize(model=module, config=config(**extra),
                                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    return engine


def batches(n: int = 3):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)) for _ in range(n)]


def test_initialize_builds_a_pipeline_engine_whose_loop_is_train_batch() -> None:
    engine = engine_for()
    assert isinstance(engine, PipelineEngine) and engine.is_first_stage() and engine.is_last_stage()
    for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
        with pytest.raises(PipelineError, match="train_batch"):
            call()
    data = batches()
    expected = sum(F.mse_loss(engine.module(x), y).item() for x, y in data) / 3
    assert engine.eval_batch(iter(data)).item() == pytest.approx(expected, rel=1e-6)
    loss = engine.train_batch(iter(data))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (1, 3, 6)
    with pytest.raises(StopIteration):
        engine.train_batch(iter(data[:2]))
    with pytest.raises(ValueError, match="not divisible"):
        engine.set_train_batch_size(5)
    engine.set_train_batch_size(8)
    assert engine.gradient_accumulation_steps() == 4 and engine.train_batch_size() == 8
    engine.destroy()


def test_training_data_is_read_through_a_repeating_loader() -> None:
    module = PipelineModule(mlp(), num_stages=1, loss_fn=F.mse_loss)
    data = [(x[0], y[0]) for x, y in batches(3)]
    engine, _, loader, _ = dsrun.initialize(model=module, config=config(), training_data=data)
    for _ in range(3):  # 9 micro-batches from a loader of 2 (3 samples, micro batch 2): it restarts
        engine.train_batch()
    assert engine.global_steps == 3
    restarted = RepeatingLoader([1, 2])
    assert [next(restarted) for _ in range(5)] == [1, 2, 1, 2, 1]
    engine.destroy()


def test_training_data_is_read_in_order_and_batches_print_deepspeeds_progress_line(capsys) -> None:
    """DeepSpeed's PipelineEngine reads ``training_data`` through an unshuffled DistributedSampler (the plain
    engine's loader shuffles): micro-batches come in the dataset's order. Every ``steps_per_print`` batches
    global rank 0 prints DeepSpeed's progress line, all DeepSpeedExamples' pipeline example shows."""
    module = PipelineModule(mlp(), num_stages=1, loss_fn=F.mse_loss)
    data = [(torch.full((4,), float(i)), torch.zeros(2)) for i in range(8)]
    engine, _, loader, _ = dsrun.initialize(model=module, config=config(steps_per_print=2), training_data=data)
    assert [next(engine.data_iterator)[0][:, 0].tolist() for _ in range(5)] == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    losses = [engine.train_batch().item() for _ in range(4)]
    lines = re.findall(r"^steps: (\d+) loss: (\d+\.\d{4}) iter time \(s\): \d+\.\d{3} samples/sec: \d+\.\d{3}$",
                       capsys.readouterr().out, re.MULTILINE)
    assert lines == [("2", f"{losses[1]:0.4f}"), ("4", f"{losses[3]:0.4f}")]
    engine.destroy()


@pytest.mark.parametrize("schedule,cls", [("1f1b", TrainSchedule), ("gpipe", GPipeSchedule),
                                          ("zero_bubble", ZeroBubbleSchedule)])
def test_pipeline_schedule_picks_the_schedule(schedule: str, cls: type) -> None:
    engine = engine_for(pipeline={"schedule": schedule})
    assert type(engine._schedule("train", 3)) is cls
    losses = [engine.train_batch(iter(batches())).item() for _ in range(2)]
    engine.destroy()
    reference = engine_for()
    assert losses == [reference.train_batch(iter(batches())).item() for _ in range(2)]  # the same arithmetic
    reference.destroy()


@pytest.mark.parametrize("key,value,match", [
    ("stages", 2, "pipeline.stages"),
    ("partition", "uniform", "pipeline.partition"),
    ("seed_layers", True, "pipeline.seed_layers"),
    ("activation_checkpoint_interval", 2, "pipeline.activation_checkpoint_interval"),
    ("schedule", "interleaved", "pipeline.schedule"),
])
def test_pipeline_keys_that_disagree_with_the_module_are_refused(key, value, match) -> None:
    extra = {"virtual_stages": 2} if key == "schedule" else {}
    with pytest.raises(ConfigError, match=match):
        engine_for(pipeline={key: value, **extra})


def test_pipeline_keys_that_agree_with_the_module_are_accepted() -> None:
    for pipeline in ({"stages": 1}, {"partition": "best"}, {"partition": "parameters"}, {"seed_layers": False},
                     {"activation_checkpoint_interval": 0}, {"pipe_partitioned": False, "grad_partitioned": False}):
        engine = engine_for(pipeline=pipeline)
        assert engine._split == {}  # no model axis: nothing to split (see test_pipe.py for a model axis)
        engine.destroy()


def test_zero_stage_3_is_refused_with_a_pipeline() -> None:
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        engine_for(zero_optimization={"stage": 3})
