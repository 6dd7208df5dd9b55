"""bf16 master state (``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states``) at ZeRO 1-3: the
masters, their gradients and Adam's moments are bf16 and take half the bytes; training stays within a derived
bound of the fp32-master run; a checkpoint resumes bit-exactly; the combinations DeepSpeed (or dsrun) does not
run are refused with one line naming the key and the stage."""
from __future__ import annotations

import math

import pytest
import torch

import dsrun
from dsrun.checkpoint.safe_load import load_file
from dsrun.config import validate_ds_config
from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.model_states import model_state_bytes

pytestmark = pytest.mark.usefixtures("world_of_one")

BF16_STATE = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
UNIT_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits: round-to-nearest is off by at most 2^-8 |w|


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4))


def _engine(stage: int, bf16_state: bool, lr: float = 1e-2):
    bf16 = {"enabled": True, **(BF16_STATE if bf16_state else {})}
    # clipping at 1e6 never clips here; it makes the step measure the gradient norm (the bound below reads it)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1e6,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
              "bf16": bf16, "zero_optimization": {"stage": stage}}
    return dsrun.initialize(model=_model(), config=config)[0]


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=gen)
    xs = [torch.randn(8, 16, generator=gen) for _ in range(2 * steps)]
    return [(x, torch.tanh(x @ teacher)) for x in xs]


def _train(engine, batches, dtype: torch.dtype = torch.bfloat16) -> list[float]:
    """One loss per micro-batch (two micro-batches per optimizer step), the inputs in the model's ``dtype``."""
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_state_holds_bf16_masters_gradients_and_states(stage):
    fp32, bf16 = _engine(stage, False), _engine(stage, True)
    for engine in (fp32, bf16):
        _train(engine, _batches(1))
    trainable = sum(p.numel() for p in _model().parameters())  # ZeRO-3's own parameters are empty: count a copy
    masters = bf16.strategy.masters
    assert {m.dtype for m in masters} == {torch.bfloat16}
    assert {m.dtype for m in fp32.strategy.masters} == {torch.float32}
    for master in masters:
        state = bf16.optimizer.state[master]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and "master_param" not in state
    if stage == 3:  # the bf16 shards are the masters themselves (DeepSpeed shares them): no copy at all
        assert all(p.ds_tensor.untyped_storage().data_ptr() == masters[0].untyped_storage().data_ptr()
                   for p in bf16.module.parameters())
    before, after = fp32.strategy.memory_breakdown(), bf16.strategy.memory_breakdown()
    assert after.optimizer_states == 2 * 2 * trainable and before.optimizer_states == 2 * 4 * trainable
    assert after.master_weights == (0 if stage == 3 else 2 * trainable)
    # stage 1 keeps the bf16 flat gradient and its reduced partition, which now is the masters' gradient too;
    # stages 2-3 keep only the partition accumulator, now bf16
    assert after.gradients == (2 * 2 * trainable if stage == 1 else 2 * trainable)
    # bytes per weight of master + master gradient + two moments: stage 1 4 + 4 + 8 -> 2 + 0 (the reduced bf16 piece
    # is the gradient) + 4; stage 2 4 + 4 + 8 -> 2 + 2 + 4; stage 3 4 + 4 + 8 -> 0 (the shards) + 2 + 4
    assert before.total - after.total == {1: 10, 2: 8, 3: 10}[stage] * trainable


@pytest.mark.parametrize("optimizer", [{"type": "Lamb", "params": {"lr": 1e-3}}, {"type": "Lion", "params": {"lr": 1e-4}},
                                       {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3}}])
def test_every_optimizer_dsrun_builds_keeps_bf16_states(optimizer):
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": optimizer, "zero_optimization": {"stage": 2},
              "bf16": {"enabled": True, **BF16_STATE}}
    engine = dsrun.initialize(model=_model(), config=config)[0]
    _train(engine, _batches(1)[:1])
    states = [v for state in engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    assert states and {v.dtype for v in states} == {torch.bfloat16}


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_master_state_trains_close_to_fp32_masters(stage):
    """The bound: both runs start from the same weights and see the same data. Each step the bf16 run rounds every
    master element to bf16, an error of at most u |w| (u = 2^-8), and its rounded moments change the update by a
    relative 1.5 u at most (exp_avg by u, sqrt(exp_avg_sq) by u/2), which is below u |w| while lr |update| < |w|.
    Adding the errors of k steps with no cancellation, the weights differ by at most ||dw|| <= 2 k u max_t ||w_t||,
    and to first order the loss by ||grad L|| ||dw||. The test measures ||grad L|| and ||w|| on the fp32 run, takes
    the larger of each over the steps, and also requires the bf16 run to learn (most of the fp32 run's drop)."""
    steps = 12
    batches = _batches(steps)
    fp32 = _engine(stage, False)
    grad_norms, weight_norms, fp32_losses = [], [], []
    for i in range(steps):
        fp32_losses += _train(fp32, batches[2 * i:2 * i + 2])
        grad_norms.append(float(fp32.get_global_grad_norm()))
        weight_norms.append(math.sqrt(sum(float(m.detach().float().square().sum()) for m in fp32.strategy.masters)))
    bf16_losses = _train(_engine(stage, True), batches)
    bound = max(grad_norms) * 2 * steps * UNIT_ROUNDOFF * max(weight_norms)
    worst = max(abs(a - b) for a, b in zip(fp32_losses, bf16_losses))
    assert worst <= bound, (worst, bound)
    assert 0 < worst  # bf16 rounding makes the runs differ: the key acted
    drop = fp32_losses[0] - fp32_losses[-1]
    assert drop > 0.1 and bf16_losses[0] - bf16_losses[-1] > 0.8 * drop


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_state_resumes_bit_exactly(stage, tmp_path):
    batches = _batches(4)
    straight = _engine(stage, True)
    _train(straight, batches[:4])
    straight.save_checkpoint(str(tmp_path), tag="t")
    saved = load_file(next(tmp_path.glob("t/*optim_states.pt")))
    osd = saved["optimizer_state_dict"]
    master_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    assert {t.dtype for t in osd[master_key]} == {torch.bfloat16}  # saved as held, as DeepSpeed saves them
    tail = _train(straight, batches[4:])
    resumed = _engine(stage, True, lr=0.5)  # a different lr: the loaded state must replace it
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert _train(resumed, batches[4:]) == tail
    for a, b in zip(straight.strategy.masters, resumed.strategy.masters):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
        state_a, state_b = straight.optimizer.state[a], resumed.optimizer.state[b]
        assert all(torch.equal(state_a[k], state_b[k]) for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimator_counts_bf16_master_state_as_the_engine_holds_it(stage):
    engine = _engine(stage, True)
    _train(engine, _batches(1))
    total = sum(p.numel() for p in _model().parameters())
    spec = EstimateInputs(total_params=total, largest_layer_params=64 * 64 + 64, zero_stage=stage, precision="bf16",
                          optimizer="AdamW", small_params=total if stage == 3 else 0,  # all below the threshold
                          bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    held = engine.strategy.memory_breakdown()
    assert model_state_bytes(spec).device_total == held.total - held.buffers
    fp32_masters = model_state_bytes(spec.with_(bf16_master_weights_and_grads=False, bf16_optimizer_states=False))
    assert fp32_masters.device_total > model_state_bytes(spec).device_total


def _refusal(config: dict) -> list[str]:
    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, **BF16_STATE}}
    merged = {**base, **config, "bf16": {**base["bf16"], **config.get("bf16", {})}}
    return [f"{p.path}: {p.message} ({p.hint})" for p in validate_ds_config(merged)]


def test_combinations_dsrun_does_not_run_are_refused_with_one_line():
    assert _refusal({"zero_optimization": {"stage": 2}}) == []
    (stage0,) = _refusal({})
    assert stage0.startswith("bf16.bf16_master_weights_and_grads:") and "stage is 0" in stage0
    (disabled,) = _refusal({"bf16": {"enabled": False}, "zero_optimization": {"stage": 1}})
    assert "bf16.enabled is false" in disabled
    (alone,) = _refusal({"bf16": {"bf16_master_weights_and_grads": False}, "zero_optimization": {"stage": 2}})
    assert alone.startswith("bf16.bf16_optimizer_states:") and "bf16_master_weights_and_grads" in alone
    (fp32_states,) = _refusal({"bf16": {"bf16_optimizer_states": False}, "zero_optimization": {"stage": 3}})
    assert "fp32 optimizer states" in fp32_states and "stage 3" in fp32_states
    (offload,) = _refusal({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert "offload_optimizer.device 'cpu'" in offload and "stage 2" in offload
    (onebit,) = _refusal({"zero_optimization": {"stage": 1}, "optimizer": {"type": "OneBitAdam"}})
    assert "OneBitAdam" in onebit and "stage 1" in onebit
