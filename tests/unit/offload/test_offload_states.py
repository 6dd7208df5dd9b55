"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's names) at ZeRO stages 1-3, in one process.

On this CPU machine the states already live in host memory, so the engine moves nothing (and says so) and only
releases the buffers it rebuilds on demand. The CUDA path (copy each named tensor to host memory, re-point every
view of it, copy back) is exercised here too: ``moved_everywhere`` makes every CPU tensor count as accelerator
memory, so each named state really goes to new host storage and back, and training must still continue exactly.
"""
from __future__ import annotations

import importlib
import logging

import pytest
import torch

import dsrun
from dsrun.alias.paths import target_of
from dsrun.offload.state_moves import HostCopies
from dsrun.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from dsrun.zero.offload_states import OffloadStatesError, get_state_devices

pytestmark = pytest.mark.usefixtures("world_of_one")
S = OffloadStateTypeEnum
MOVED = [S.optim_states, S.hp_params, S.lp_params, S.lp_grads]  # the states that are tensors, not buffers


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _config(stage: int, bf16: bool = False, offload: str = "none", **zero) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 200, "sub_group_size": 300,
            "stage3_param_persistence_threshold": 20, "offload_optimizer": {"device": offload}, **zero}
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": zero, "steps_per_print": 1000}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(n)]


def _backward(engine, batch) -> float:
    x, y = batch
    loss = torch.nn.functional.mse_loss(engine(x.to(engine.module[0].weight.dtype)).float(), y)
    engine.backward(loss)
    return loss.item()


def _train(engine, batches) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(_backward(engine, batch))
        engine.step()
    return losses


def _masters(engine) -> list[torch.Tensor]:
    return [m.detach().clone() for m in engine.strategy.masters]


@pytest.fixture
def moved_everywhere(monkeypatch):
    """Every CPU tensor counts as accelerator memory: offload_states copies each named one to new host storage."""
    monkeypatch.setattr(HostCopies, "on_accelerator", staticmethod(lambda tensor: tensor.device.type != "meta"))


def _storages(engine, state) -> list[torch.UntypedStorage]:
    """The storages of ``state``'s tensors; holding them keeps freed memory from being handed out again."""
    return [item.tensor.untyped_storage() for item in engine.strategy.state_tensors(state) if item.tensor.numel()]


def _shared(now: list[torch.UntypedStorage], before: list[torch.UntypedStorage]) -> bool:
    return bool({s.data_ptr() for s in now} & {s.data_ptr() for s in before})


def _values(engine, state) -> list[torch.Tensor]:
    return [item.tensor.detach().clone() for item in engine.strategy.state_tensors(state)]


CASES = [(1, False, "none"), (2, False, "none"), (3, False, "none"), (1, True, "none"), (2, True, "none"),
         (3, True, "none"), (2, True, "cpu"), (3, False, "cpu"), (3, True, "cpu")]


@pytest.mark.parametrize("stage,bf16,offload", CASES)
def test_training_continues_bit_identically_after_moving_every_state(stage, bf16, offload, moved_everywhere):
    batches = _batches(5)
    reference = dsrun.initialize(model=_model(), config=_config(stage, bf16, offload))[0]
    expected = _train(reference, batches)
    engine = dsrun.initialize(model=_model(), config=_config(stage, bf16, offload))[0]
    losses = _train(engine, batches[:2])
    before = {state: (_storages(engine, state), _values(engine, state)) for state in MOVED}
    engine.offload_states()
    assert engine.strategy.offloaded_states == set(OffloadStateTypeEnum)
    for state in MOVED:  # every tensor of every state is in new storage, with its value
        storages, values = before[state]
        assert not _shared(_storages(engine, state), storages), state
        for value, now in zip(values, _values(engine, state)):
            assert torch.equal(value, now), state
    assert engine.strategy.gradient_buckets() == [] and get_state_devices(engine, S.contiguous_grad_buffer) == set()
    engine.reload_states()
    assert engine.strategy.offloaded_states == set()
    losses += _train(engine, batches[2:])
    assert losses == expected
    for mine, theirs in zip(_masters(engine), _masters(reference)):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("stage,bf16", [(1, True), (2, False), (3, True), (3, False)])
@pytest.mark.parametrize("state", MOVED)
def test_include_moves_only_the_named_state(stage, bf16, state, moved_everywhere):
    batches = _batches(4)
    expected = _train(dsrun.initialize(model=_model(), config=_config(stage, bf16))[0], batches)
    engine = dsrun.initialize(model=_model(), config=_config(stage, bf16))[0]
    losses = _train(engine, batches[:2])
    before = {s: _storages(engine, s) for s in MOVED}
    engine.offload_states(include=[state], device=OffloadDeviceEnum.cpu, pin_memory=False, non_blocking=True)
    assert engine.strategy.offloaded_states == {state}
    # at fp32 stage 3 the model's shards are views of the fp32 masters: either state moves both
    together = {state} | ({S.hp_params, S.lp_params} if stage == 3 and not bf16 and state in (S.hp_params,
                                                                                            S.lp_params) else set())
    for other in MOVED:
        moved = not _shared(_storages(engine, other), before[other])
        assert moved == (other in together), other
    engine.reload_states(non_blocking=True)
    losses += _train(engine, batches[2:])
    assert losses == expected


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_between_backward_and_step_survive_the_round_trip(stage, moved_everywhere):
    batches = _batches(3)
    expected = _train(dsrun.initialize(model=_model(), config=_config(stage, True))[0], batches)
    engine = dsrun.initialize(model=_model(), config=_config(stage, True))[0]
    losses = _train(engine, batches[:1])
    losses.append(_backward(engine, batches[1]))  # reduced gradients wait for the step
    grads = _values(engine, S.lp_grads)
    engine.offload_states(include=[S.lp_grads])
    for grad, now in zip(grads, _values(engine, S.lp_grads)):
        assert torch.equal(grad, now)
    engine.reload_states()
    engine.step()
    losses += _train(engine, batches[2:])
    assert losses == expected


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_the_cpu_the_states_stay_in_host_memory_and_that_is_said_once(stage, caplog):
    batches = _batches(6)
    expected = _train(dsrun.initialize(model=_model(), config=_config(stage, True))[0], batches)
    engine = dsrun.initialize(model=_model(), config=_config(stage, True))[0]
    losses = _train(engine, batches[:2])
    buckets = len(engine.strategy.gradient_buckets())
    # stage 2 keeps reduce buffers for the next step; stage 3 at a world of one keeps its parameters whole and
    # adds each gradient straight into its accumulator, with no bucket (dsrun/zero/whole_params.py)
    assert (buckets > 0) == (stage == 2)
    storages = {state: _storages(engine, state) for state in MOVED}
    with caplog.at_level(logging.WARNING, logger="dsrun.zero"):
        for cycle in range(2):
            engine.offload_states()
            assert engine.strategy.offloaded_states == set(OffloadStateTypeEnum)
            for state in MOVED:  # nothing copied: the same storage, on the host
                now = _storages(engine, state)
                assert [x.data_ptr() for x in now] == [x.data_ptr() for x in storages[state]]
                assert get_state_devices(engine, state) == {torch.device("cpu")}
            assert engine.strategy.gradient_buckets() == []  # released: rebuilt on demand
            engine.reload_states()
            assert len(engine.strategy.gradient_buckets()) == buckets
            losses += _train(engine, batches[2 + 2 * cycle:4 + 2 * cycle])
    notes = [r.getMessage() for r in caplog.records if "already live in host memory" in r.getMessage()]
    assert len(notes) == 1 and "hp_params" in notes[0] and "lp_params" in notes[0]
    assert losses == expected


def test_bad_requests_are_refused_in_one_line(caplog):
    engine = dsrun.initialize(model=_model(), config=_config(2))[0]
    _train(engine, _batches(1))
    with pytest.raises(OffloadStatesError, match=r"include=\.\.\.\): got <OffloadStateTypeEnum.hp_params"):
        engine.offload_states(include=S.hp_params)
    with pytest.raises(OffloadStatesError, match="'master_weights' is not a state; allowed: optim_states"):
        engine.offload_states(include=["master_weights"])
    with pytest.raises(ValueError, match="only OffloadDeviceEnum.cpu is supported"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with caplog.at_level(logging.WARNING, logger="dsrun.zero"):
        engine.offload_states(device=OffloadDeviceEnum.none)
    assert "device=none" in caplog.text and engine.strategy.offloaded_states == set()
    engine.offload_states(include=["lp_params"])  # DeepSpeed's values as strings are its names too
    assert engine.strategy.offloaded_states == {S.lp_params}
    engine.reload_states()

    stage0 = dsrun.initialize(model=_model(), config=_config(0))[0]
    for call in (stage0.offload_states, stage0.reload_states):
        with pytest.raises(OffloadStatesError, match="ZeRO stage 0 keeps no offloadable states"):
            call()
    bare = dsrun.initialize(model=_model(), config={"train_batch_size": 4})[0]
    with pytest.raises(OffloadStatesError, match="the engine has no optimizer"):
        bare.offload_states()
    params_offloaded = dsrun.initialize(model=_model(), config=_config(3, offload_param={"device": "cpu"}))[0]
    with pytest.raises(OffloadStatesError, match="offload_param puts the parameters on cpu"):
        params_offloaded.offload_states()
    zeropp = dsrun.initialize(model=_model(), config=_config(3, zero_quantized_weights=True))[0]
    with pytest.raises(OffloadStatesError, match="not with ZeRO\\+\\+/MiCS/hpZ"):
        zeropp.offload_states(include=[S.optim_states])


def test_deepspeeds_module_paths_serve_the_names():
    config = importlib.import_module(target_of("deepspeed.runtime.zero.offload_config"))
    states = importlib.import_module(target_of("deepspeed.runtime.zero.offload_states"))
    assert config.OffloadStateTypeEnum is S and config.OffloadDeviceEnum is OffloadDeviceEnum
    assert [s.value for s in S] == ["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]
    assert states.get_state_devices is get_state_devices and S["lp_grads"] == "lp_grads"
