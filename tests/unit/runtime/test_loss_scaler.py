"""DeepSpeed's loss scalers at ``deepspeed.runtime.fp16.loss_scaler``: its constructors, defaults and attributes,
and the objects that checkpoint files name resolving to them under the alias (a plain ``torch.load``)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dsrun.checkpoint.deepspeed_format import PICKLE_MODULE, ForeignObject, zero_state_for_deepspeed
from dsrun.precision.loss_scaler import DynamicLossScaler, LossScaler
from tests.helpers import REPO


def test_deepspeeds_defaults_and_attributes():
    static = LossScaler()
    assert (static.cur_scale, static.loss_scale, static.dynamic) == (1.0, 1.0, False)
    assert not static.has_overflow([]) and LossScaler(scale=128).loss_scale == 128
    dynamic = DynamicLossScaler()
    assert (dynamic.cur_scale, dynamic.scale_factor, dynamic.scale_window, dynamic.min_scale) == (2.0 ** 32, 2.0, 1000, 1)
    assert (dynamic.delayed_shift, dynamic.cur_hysteresis, dynamic.consecutive_hysteresis) == (1, 1, False)
    assert (dynamic.cur_iter, dynamic.last_overflow_iter, dynamic.dynamic, dynamic.dtype) == (0, -1, True, torch.half)


def test_an_overflow_at_the_minimum_scale_is_an_error_unless_told():
    scaler = DynamicLossScaler(init_scale=2, min_scale=1)
    scaler.update_scale(True)
    assert scaler.cur_scale == 1
    with pytest.raises(RuntimeError, match="minimum"):
        scaler.update_scale(True)
    floor = DynamicLossScaler(init_scale=1, min_scale=1, raise_error_at_min_scale=False)
    floor.update_scale(True)
    assert floor.cur_scale == 1


def test_overflow_check_and_scaled_backward():
    weight = torch.nn.Parameter(torch.ones(3))
    scaler = DynamicLossScaler(init_scale=8)
    scaler.backward((weight * torch.tensor([1.0, 2.0, 3.0])).sum())
    assert torch.equal(weight.grad, torch.tensor([8.0, 16.0, 24.0]))  # powers of two: exact
    assert not scaler.has_overflow_serial([weight])
    weight.grad[1] = float("inf")
    assert scaler.has_overflow([weight]) and DynamicLossScaler._has_inf_or_nan(torch.tensor([float("nan")]))


def _alias_load(path) -> str:
    code = ("import sys, torch; sd = torch.load(sys.argv[1], weights_only=False)['optimizer_state_dict']; s = "
            "sd['loss_scaler']; print(type(s).__module__, type(s).__name__, s.loss_scale, s.dynamic); "
            "s.update_scale(False); print(s.cur_scale, getattr(s, 'cur_iter', '-'))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{REPO / 'dsrun/alias/site'}:{REPO}", "PATH": "/usr/bin:/bin",
                               "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_checkpoint_scalers_load_as_these_classes_under_the_alias(tmp_path):
    # what dsrun writes into a bf16/fp32 ZeRO optimizer-states file, and a dynamic scaler as DeepSpeed pickles it
    dsrun_file, deepspeed_file = tmp_path / "dsrun.pt", tmp_path / "deepspeed.pt"
    torch.save({"optimizer_state_dict": zero_state_for_deepspeed({"zero_stage": 2}, "bf16", 1.0)}, dsrun_file,
               pickle_module=PICKLE_MODULE)
    state = {"cur_scale": 1024.0, "cur_iter": 9, "last_overflow_iter": 5, "scale_factor": 2.0, "scale_window": 4,
             "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 2, "consecutive_hysteresis": False,
             "raise_error_at_min_scale": True, "dynamic": True, "dtype": torch.float16}
    scaler = ForeignObject("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", state, newobj=True)
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler}}, deepspeed_file, pickle_module=PICKLE_MODULE)
    assert _alias_load(dsrun_file).split() == ["dsrun.precision.loss_scaler", "LossScaler", "1.0", "False",
                                               "1.0", "-"]
    # iteration 9 is 4 (the window) after the overflow at 5: the scale doubles
    assert _alias_load(deepspeed_file).split() == ["dsrun.precision.loss_scaler", "DynamicLossScaler", "1024.0",
                                                   "True", "2048.0", "10"]
