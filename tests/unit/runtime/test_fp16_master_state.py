"""fp16 master state (``fp16.fp16_master_weights_and_grads``: DeepSpeed's ZeRO 1-3 with CPU optimizer offload and
its CPU Adam): the host masters and their gradients are fp16 and take half the bytes, Adam's moments stay fp32;
training stays within a derived bound of the fp32-master run and resumes bit-exactly; the estimator counts what the
engine holds; the combinations DeepSpeed (or dsrun) does not run are refused with one line."""
from __future__ import annotations

import math

import pytest
import torch

import dsrun
from dsrun.checkpoint.safe_load import load_file
from dsrun.config import validate_ds_config
from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.model_states import model_state_bytes
from dsrun.utils.errors import ConfigError
from tests.unit.runtime.test_bf16_master_state import _batches, _model
from tests.unit.runtime.test_bf16_master_state import _train as _train_in

pytestmark = pytest.mark.usefixtures("world_of_one")

UNIT_ROUNDOFF = 2.0 ** -11  # fp16 keeps 11 significant bits: round-to-nearest is off by at most 2^-11 |w|


def _engine(stage: int, fp16_masters: bool):
    # a static loss scale: an overflow skip in one run and not the other would end the comparison; clipping at 1e6
    # never clips here, it makes the step measure the gradient norm (the bound below reads it)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1e6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "fp16": {"enabled": True, "loss_scale": 256, "fp16_master_weights_and_grads": fp16_masters},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    return dsrun.initialize(model=_model(), config=config)[0]


def _train(engine, batches) -> list[float]:
    return _train_in(engine, batches, torch.float16)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_master_state_halves_the_host_master_and_gradient_bytes(stage):
    fp32, fp16 = _engine(stage, False), _engine(stage, True)
    for engine in (fp32, fp16):
        _train(engine, _batches(1))
    trainable = sum(p.numel() for p in _model().parameters())
    assert {m.dtype for m in fp32.strategy.masters} == {torch.float32}
    assert {m.dtype for m in fp16.strategy.masters} == {torch.float16}
    for master in fp16.strategy.masters:  # DeepSpeedCPUAdam steps the fp16 master itself, with fp32 moments
        state = fp16.optimizer.state[master]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32 and "master_param" not in state
    before, after = fp32.strategy.memory_breakdown(), fp16.strategy.memory_breakdown()
    assert before.optimizer_states == after.optimizer_states == 2 * 4 * trainable
    # the host gradient the step reads: fp32 -> fp16
    assert before.gradients - after.gradients == 2 * trainable
    if stage == 3:  # on a CPU device the fp16 shards are views of the fp16 host masters: no copy at all
        assert before.master_weights == 4 * trainable and after.master_weights == 0
        assert all(p.ds_tensor.untyped_storage().data_ptr() == fp16.strategy.masters[0].untyped_storage().data_ptr()
                   for p in fp16.module.parameters())
    else:
        assert (before.master_weights, after.master_weights) == (4 * trainable, 2 * trainable)
    # the estimator counts the same difference (host memory is the device's on a CPU run)
    spec = EstimateInputs(total_params=trainable, largest_layer_params=64 * 64 + 64, zero_stage=stage,
                          precision="fp16", optimizer="AdamW", offload_optimizer="cpu", device="cpu",
                          small_params=trainable if stage == 3 else 0)
    saved = model_state_bytes(spec).host - model_state_bytes(spec.with_(fp16_master_weights_and_grads=True)).host
    assert saved == (before.total - before.buffers) - (after.total - after.buffers)


def test_the_estimator_reads_the_key_from_a_run_config():
    from omegaconf import OmegaConf

    from dsrun.estimate.runspec import build_recipe_model, inputs_from_runspec

    model = build_recipe_model(OmegaConf.create({"model": {"_target_": "torch.nn.Linear", "in_features": 64,
                                                           "out_features": 64}}))
    ds = {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    spec, sources = inputs_from_runspec(OmegaConf.create({"ds": ds}), model)
    assert spec.fp16_master_state and sources["fp16_master_state"] == "ds.fp16.fp16_master_weights_and_grads"
    fp32 = model_state_bytes(spec.with_(fp16_master_weights_and_grads=False))
    assert fp32.host - model_state_bytes(spec).host == 4 * (64 * 64 + 64)  # 2 + 2 bytes per trainable parameter


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_master_state_trains_close_to_fp32_masters(stage):
    """The bound, as for bf16 master state (test_bf16_master_state.py) with fp16's unit roundoff u = 2^-11: both runs
    start from the same weights and see the same data; each step the fp16 run rounds every master element (at most
    u |w|) and unscales its gradient in fp16 (a relative u, which moves Adam's update by a relative 1.5 u at most,
    below u |w| while lr |update| < |w|). Over k steps with no cancellation the weights differ by at most
    2 k u max_t ||w_t||, the loss to first order by ||grad L|| times that; ||grad L|| and ||w|| are measured on the
    fp32 run. The fp16 run must also learn (most of the fp32 run's drop)."""
    steps = 12
    batches = _batches(steps)
    fp32 = _engine(stage, False)
    grad_norms, weight_norms, fp32_losses = [], [], []
    for i in range(steps):
        fp32_losses += _train(fp32, batches[2 * i:2 * i + 2])
        grad_norms.append(float(fp32.get_global_grad_norm()))
        weight_norms.append(math.sqrt(sum(float(m.detach().float().square().sum()) for m in fp32.strategy.masters)))
    fp16_losses = _train(_engine(stage, True), batches)
    bound = max(grad_norms) * 2 * steps * UNIT_ROUNDOFF * max(weight_norms)
    worst = max(abs(a - b) for a, b in zip(fp32_losses, fp16_losses))
    assert worst <= bound, (worst, bound)
    assert 0 < worst  # fp16 rounding makes the runs differ: the key acted
    drop = fp32_losses[0] - fp32_losses[-1]
    assert drop > 0.1 and fp16_losses[0] - fp16_losses[-1] > 0.8 * drop


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_master_state_resumes_bit_exactly(stage, tmp_path):
    batches = _batches(4)
    straight = _engine(stage, True)
    _train(straight, batches[:4])
    straight.save_checkpoint(str(tmp_path), tag="t")
    osd = load_file(next(tmp_path.glob("t/*optim_states.pt")))["optimizer_state_dict"]
    master_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    assert {t.dtype for t in osd[master_key]} == {torch.float16}  # saved as held, as DeepSpeed saves them
    tail = _train(straight, batches[4:])
    resumed = _engine(stage, True)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert _train(resumed, batches[4:]) == tail
    for a, b in zip(straight.strategy.masters, resumed.strategy.masters):
        assert a.dtype == b.dtype == torch.float16 and torch.equal(a, b)


def _refusal(zero: dict, **config) -> list[str]:
    merged = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, **config}
    return [f"{p.path}: {p.message} ({p.hint})" for p in validate_ds_config(merged)]


def test_combinations_deepspeed_or_dsrun_does_not_run_are_refused_with_one_line():
    cpu = {"device": "cpu"}
    for stage in (1, 2, 3):
        assert _refusal({"stage": stage, "offload_optimizer": cpu}) == []
    assert _refusal({"stage": 0}, fp16={"enabled": False, "fp16_master_weights_and_grads": True}) == []  # unread
    (stage0,) = _refusal({"stage": 0})
    assert stage0.startswith("fp16.fp16_master_weights_and_grads:") and "stage is 0" in stage0
    (no_offload,) = _refusal({"stage": 2})
    assert "DeepSpeedCPUAdam" in no_offload and "offload_optimizer.device is none" in no_offload
    (lion,) = _refusal({"stage": 2, "offload_optimizer": cpu}, optimizer={"type": "Lion", "params": {"lr": 1e-4}})
    assert "DeepSpeedCPUAdam" in lion and "Lion" in lion
    # torch's Adam on the host, which zero_force_ds_cpu_optimizer false allows otherwise: DeepSpeed still refuses
    (torch_adam,) = _refusal({"stage": 1, "offload_optimizer": cpu}, zero_force_ds_cpu_optimizer=False,
                             optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}})
    assert "DeepSpeedCPUAdam" in torch_adam and "torch_adam" in torch_adam
    (nvme,) = _refusal({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}})
    assert "'nvme'" in nvme and "not implemented" in nvme
    (partial,) = _refusal({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    assert "ratio 0.5" in partial and "not implemented" in partial
    # a client optimizer object that is not DeepSpeedCPUAdam (torch's, on the host: zero_force_ds_cpu_optimizer false)
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_force_ds_cpu_optimizer": False,
              "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="fp16.fp16_master_weights_and_grads: .*DeepSpeedCPUAdam.* AdamW"):
        dsrun.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
