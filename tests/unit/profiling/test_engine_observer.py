"""The engine's own reporting: DeepSpeed's event names keyed by global samples, the wall-clock breakdown
averaged over steps_per_print, and the flops profile of one step."""
from __future__ import annotations

import pytest
import torch

import dsrun

pytestmark = pytest.mark.usefixtures("world_of_one")


def _engine(tmp_path, **extra):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}, **extra}
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine, steps: int, dtype: torch.dtype = torch.float32) -> list[float]:
    losses = []
    for _ in range(steps):
        step_loss = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = torch.randn(4, 16), torch.randn(4, 1)
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / engine.gradient_accumulation_steps()
        losses.append(step_loss)
    return losses


def _rows(path):
    return [line.split(",") for line in path.read_text().splitlines()[1:]]


def test_engine_writes_deepspeeds_events_at_global_samples(tmp_path):
    engine = _engine(tmp_path, wall_clock_breakdown=True)
    losses = _train(engine, 4)
    engine.monitor.close()
    job = tmp_path / "job"
    loss_rows = _rows(job / "Train_Samples_train_loss.csv")
    assert [int(step) for step, _ in loss_rows] == [8, 16, 24, 32]  # global samples, not steps
    assert [float(v) for _, v in loss_rows] == pytest.approx(losses, rel=1e-5)
    assert [float(v) for _, v in _rows(job / "Train_Samples_lr.csv")] == pytest.approx([0.01] * 4)
    assert not (job / "Train_Samples_loss_scale.csv").exists()  # fp16 only
    for timer in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        rows = _rows(job / f"Train_Samples_elapsed_time_ms_{timer}.csv")
        assert [int(step) for step, _ in rows] == [16, 32]  # every steps_per_print = 2 steps
        assert all(float(v) >= 0 for _, v in rows)
    assert (job / "Train_Samples_train_loss.csv").read_text().startswith("step,train_loss\n")


def test_flops_profiler_reports_the_profile_step(tmp_path):
    out = tmp_path / "flops.txt"
    engine = _engine(tmp_path, flops_profiler={"enabled": True, "profile_step": 1, "output_file": str(out)})
    _train(engine, 3)
    engine.monitor.close()
    text = out.read_text()
    assert text == engine.observer.flops_report
    assert "Profile Summary at step 1:" in text
    macs = 4 * 16 * 32 + 4 * 32 * 1  # one micro-batch of 4 through both Linears
    assert "fwd MACs per GPU:".ljust(72) + f"{round(macs / 1e3, 2)} KMACs" in text
    for key in ("bwd latency:", "step latency:", "iter latency:", "samples/second:", "world size:"):
        assert key in text
    rows = _rows(tmp_path / "job" / "Train_Samples_fwd_flops_per_gpu.csv")
    assert rows == [["16", repr(float(2 * macs + 4 * 32))]]  # Linears (2 x MACs) + ReLU (1 per element)


def test_fp16_adds_the_loss_scale_event(tmp_path):
    engine = _engine(tmp_path, fp16={"enabled": True, "initial_scale_power": 8})
    _train(engine, 2, torch.float16)
    engine.monitor.close()
    rows = _rows(tmp_path / "job" / "Train_Samples_loss_scale.csv")
    assert [int(step) for step, _ in rows] == [8, 16]
    assert float(rows[-1][1]) == engine.cur_scale
