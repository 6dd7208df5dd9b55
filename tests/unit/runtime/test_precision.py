"""Loss scaling: DeepSpeed's dynamic scaler (hysteresis, window, minimum) and the config mapping."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dsrun.precision.loss_scaler import DynamicLossScaler, LossScaler
from dsrun.precision.strategy import BF16Precision, FP16Precision, PrecisionStrategy, build_precision


def _run(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        out.append(scaler.cur_scale)
    return out


def test_hysteresis_absorbs_overflows_before_halving() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=1000, delayed_shift=2)
    # the first overflow uses up the hysteresis; the second halves; hysteresis stays spent
    assert _run(scaler, [True, True, True]) == [1024, 512, 256]


def test_scale_grows_after_window_clean_steps_and_refills_hysteresis() -> None:
    scaler = DynamicLossScaler(init_scale=8, scale_window=3, delayed_shift=2)
    assert _run(scaler, [True, True]) == [8, 4]
    assert _run(scaler, [False, False, False]) == [4, 4, 8]
    assert scaler.cur_hysteresis == 2
    assert _run(scaler, [True]) == [8]  # hysteresis is back


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    scaler = DynamicLossScaler(init_scale=64, scale_window=100, delayed_shift=2, consecutive_hysteresis=True)
    assert _run(scaler, [True, False, True, False, True, True]) == [64, 64, 64, 64, 64, 32]


def test_min_scale_is_a_floor() -> None:
    scaler = DynamicLossScaler(init_scale=4, scale_window=100, delayed_shift=1, min_scale=2,
                               raise_error_at_min_scale=False)
    assert _run(scaler, [True, True, True]) == [2, 2, 2]


def test_first_growth_counts_from_the_start() -> None:
    assert _run(DynamicLossScaler(init_scale=2, scale_window=2, delayed_shift=1), [False] * 4) == [2, 4, 4, 8]


def test_build_precision_from_config_sections() -> None:
    fp16 = SimpleNamespace(enabled=True, loss_scale=0.0, initial_scale_power=12, loss_scale_window=7, hysteresis=3,
                           consecutive_hysteresis=False, min_loss_scale=4.0)
    p = build_precision(fp16, None)
    assert isinstance(p, FP16Precision) and p.loss_scale == 4096 and p.model_dtype == torch.float16
    assert p.scaler.scale_window == 7 and p.scaler.delayed_shift == 3 and p.scaler.min_scale == 4.0
    assert p.checks_overflow and p.needs_master_weights
    static = build_precision(SimpleNamespace(enabled=True, loss_scale=128.0), None)
    assert isinstance(static.scaler, LossScaler) and static.loss_scale == 128
    static.update(True)
    assert static.loss_scale == 128
    assert isinstance(build_precision(SimpleNamespace(enabled=False), SimpleNamespace(enabled=True)), BF16Precision)
    plain = build_precision(None, None)
    assert type(plain) is PrecisionStrategy and not plain.needs_master_weights and plain.loss_scale == 1.0


def test_fp16_scales_the_loss_in_fp32() -> None:
    p = FP16Precision(DynamicLossScaler(init_scale=2.0 ** 16, delayed_shift=2))
    scaled = p.scale_loss(torch.tensor(3.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 65536
    p.update(True)
    p.update(True)
    assert p.state_dict()["loss_scaler"]["cur_scale"] == 32768
