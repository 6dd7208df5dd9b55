"""``data_types.grad_accum_dtype`` and ``bf16.immediate_grad_update`` at ZeRO 1-3: each run equals a single-process
reference that accumulates the same bf16 micro-step gradients in the same dtype (bit for bit: the same additions in
the same order), the two accumulation dtypes differ by no more than bf16's rounding of k - 1 additions allows, the
gradient bytes the strategy holds move as counted, and so does the estimator; DeepSpeed's refusals are kept."""
from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.config import validate_ds_config
from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.model_states import model_state_bytes

pytestmark = pytest.mark.usefixtures("world_of_one")

MICRO_STEPS = 4
LR = 0.05
UNIT_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits: one rounding is off by at most 2^-8 of the value


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


TRAINABLE = sum(p.numel() for p in _model().parameters())  # 676: even, so ZeRO's alignment adds no padding


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=gen) for _ in range(steps * MICRO_STEPS)]
    return [(x.bfloat16(), torch.sin(x[:, :4])) for x in xs]


def _engine(stage: int, accum: str | None = None, immediate: bool = False):
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": MICRO_STEPS,
              "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": True, "immediate_grad_update": immediate}, "zero_optimization": {"stage": stage}}
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    model = _model()
    return dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)[0]


def _train(engine, batches) -> tuple[list[float], list[torch.Tensor]]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return losses, weights


def _reference(batches, accum: torch.dtype) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor],
                                                     list[torch.Tensor]]:
    """One process, plain torch: a bf16 model with fp32 masters; each micro-step's bf16 gradients (of the loss over
    the accumulation steps, as the engine scales it) added in ``accum``; SGD on the masters at each boundary. Returns
    the losses, the bf16 weights, the fp32 masters and, per parameter, the sum of |micro-step gradient| of the first
    optimizer step (the bound reads it)."""
    model = _model().bfloat16()
    masters = [p.detach().float() for p in model.parameters()]
    losses, magnitude = [], [torch.zeros_like(m) for m in masters]
    for step in range(len(batches) // MICRO_STEPS):
        sums = [torch.zeros_like(m, dtype=accum) for m in masters]
        for x, y in batches[step * MICRO_STEPS:(step + 1) * MICRO_STEPS]:
            model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            (loss.float() / MICRO_STEPS).backward()
            losses.append(float(loss.detach()))
            for total, size, p in zip(sums, magnitude, model.parameters()):
                total.add_(p.grad)
                if step == 0:
                    size.add_(p.grad.float().abs())
        with torch.no_grad():
            for master, total, p in zip(masters, sums, model.parameters()):
                master.add_(total.float(), alpha=-LR)
                p.copy_(master)
    return losses, [p.detach().clone() for p in model.parameters()], masters, magnitude


def _equal(run, reference) -> None:
    assert run[0] == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(run[1], reference[1]))


@pytest.mark.parametrize("immediate", [True, False], ids=["immediate", "after-backward"])
def test_stage1_fp32_accumulation_of_bf16_gradients_equals_the_reference(immediate):
    """ZeRO-1 with ``grad_accum_dtype: fp32`` (DeepSpeed's BF16_Optimizer) adds each bf16 micro-step gradient into
    an fp32 accumulator: it equals the fp32-accumulating reference, while the stage's own bf16 accumulation equals
    the bf16-accumulating one. The two references differ after one step by at most lr (k - 1) u sum_i |g_i| per
    master weight: each of the k - 1 bf16 additions rounds a partial sum no larger than sum_i |g_i| by u of it (the
    fp32 sums' own rounding, k 2^-24 sum_i |g_i|, is added too)."""
    batches = _batches(2)
    fp32_ref, bf16_ref = _reference(batches, torch.float32), _reference(batches, torch.bfloat16)
    _equal(_train(_engine(1, "fp32", immediate), batches), fp32_ref)
    _equal(_train(_engine(1), batches), bf16_ref)
    one_step_fp32, one_step_bf16 = _reference(batches[:MICRO_STEPS], torch.float32), \
        _reference(batches[:MICRO_STEPS], torch.bfloat16)
    differ = False
    for a, b, size in zip(one_step_fp32[2], one_step_bf16[2], one_step_fp32[3]):
        bound = LR * ((MICRO_STEPS - 1) * UNIT_ROUNDOFF + MICRO_STEPS * 2.0 ** -24) * size
        assert bool(((a - b).abs() <= bound).all())
        differ = differ or not torch.equal(a, b)
    assert differ  # the accumulation dtype acted


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_3_accumulate_in_bf16_as_the_reference_and_hold_half_the_gradient_bytes(stage):
    """At stages 2-3 dsrun's own partition accumulators are fp32; ``grad_accum_dtype: bf16`` keeps them in bf16, as
    DeepSpeed's ZeRO-2/3 do with it: the run equals the bf16-accumulating reference and holds 2 bytes of gradient
    per weight instead of 4 (counted by the strategy, read before the step's copy is dropped)."""
    batches = _batches(2)
    own, low = _engine(stage), _engine(stage, "bf16")
    held = own.strategy.memory_breakdown().gradients, low.strategy.memory_breakdown().gradients
    assert held == (4 * TRAINABLE, 2 * TRAINABLE)
    _equal(_train(own, batches), _reference(batches, torch.float32))
    _equal(_train(low, batches), _reference(batches, torch.bfloat16))


def test_stage1_fp32_accumulator_is_counted():
    """ZeRO-1 (one rank) holds the bf16 flat gradient, its reduced bf16 partition and the fp32 master gradient (2 + 2
    + 4 bytes a weight); with ``grad_accum_dtype: fp32`` the bf16 flat gradient, the fp32 accumulator and the fp32
    reduced partition, which is the master gradient itself (2 + 4 + 4)."""
    own, fp32 = _engine(1), _engine(1, "fp32")
    assert own.strategy.memory_breakdown().gradients == 8 * TRAINABLE
    assert fp32.strategy.memory_breakdown().gradients == 10 * TRAINABLE
    own.destroy()
    fp32.destroy()


def test_immediate_grad_update_adds_each_gradient_as_its_hook_fires():
    """With ``immediate_grad_update`` the first layer's weight is in the fp32 accumulator by the time a hook
    registered after the engine's sees its gradient; without it, only once backward is over. Both train the same."""
    seen = {}
    for immediate in (True, False):
        engine = _engine(1, "fp32", immediate)
        weight = engine.module[0].weight
        total = engine.strategy.accumulator.sums[0]
        def look(param: torch.Tensor, key: bool = immediate) -> None:
            seen.setdefault(key, float(total.abs().sum()))
        weight.register_post_accumulate_grad_hook(look)
        x, y = _batches(1)[0]
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        seen[(immediate, "after")] = float(total.abs().sum())
        engine.destroy()
    assert seen[True] > 0 and seen[False] == 0
    assert seen[(True, "after")] == seen[(False, "after")] > 0


def _refusal(config: dict) -> list[str]:
    merged = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, **config}
    return [f"{p.path}: {p.message} ({p.hint})" for p in validate_ds_config(merged)]


def test_grad_accum_dtype_is_refused_where_deepspeed_or_dsrun_cannot_run_it():
    fp32 = {"data_types": {"grad_accum_dtype": "fp32"}}
    assert _refusal({**fp32, "zero_optimization": {"stage": 1}}) == []
    assert _refusal({"data_types": {"grad_accum_dtype": "bf16"}, "zero_optimization": {"stage": 3}}) == []
    assert _refusal({"data_types": {"grad_accum_dtype": "bf16"}}) == []  # stage 0 in the model's dtype
    (stage0,) = _refusal(fp32)  # DeepSpeed 0.19: NotImplementedError without ZeRO
    assert stage0.startswith("data_types.grad_accum_dtype:") and "stage is 0" in stage0
    (offload,) = _refusal({"data_types": {"grad_accum_dtype": "bf16"},
                           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert "offload_optimizer.device 'cpu'" in offload and "stage 2" in offload
    (onebit,) = _refusal({**fp32, "zero_optimization": {"stage": 1}, "optimizer": {"type": "OneBitAdam"}})
    assert "OneBitAdam" in onebit and "stage 1" in onebit


@pytest.mark.parametrize("stage, accum", [(1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_estimator_counts_the_gradient_buffer_dtype(stage, accum):
    """The estimator's model states equal the bytes the strategy holds with and without the key, and move the way
    the counted gradient bytes do (up at stage 1, down at stages 2-3)."""
    spec = EstimateInputs(total_params=TRAINABLE, largest_layer_params=16 * 32 + 32, zero_stage=stage,
                          precision="bf16", optimizer="SGD", small_params=TRAINABLE if stage == 3 else 0)
    totals = []
    for asked in (None, accum):
        engine = _engine(stage, asked)
        held = engine.strategy.memory_breakdown()
        estimate = model_state_bytes(spec.with_(grad_accum_dtype=asked))
        assert estimate.device_gradients == held.gradients
        assert estimate.device_total == held.total - held.buffers
        totals.append(estimate.device_total)
        engine.destroy()
    assert (totals[1] > totals[0]) == (stage == 1) and totals[1] != totals[0]
