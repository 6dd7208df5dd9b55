"""`dsrun train` reports model FLOPs utilisation: the device's peak once at start, TFLOP/s and MFU on every
progress line, and both as metrics (CSV, TensorBoard, metrics.json)."""
import csv
import json
import math

import pytest

from tests.helpers import free_port, run_cli


@pytest.mark.slow  # one rank trains 3 steps
def test_short_run_reports_peak_tflops_and_mfu(tmp_path):
    steps = 3
    result = run_cli("train", "monitor=csv", "+ds.tensorboard.enabled=true", "+ds.tensorboard.job_name=dsrun",
                     "launcher.num_procs=1", f"launcher.master_port={free_port()}", f"train.max_steps={steps}",
                     "train.eval_iters=1", "train.eval_interval=0", "data.max_bytes=300000", "ds.steps_per_print=1",
                     cwd=tmp_path, env={"DSRUN_MLFLOW": "false"}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = tmp_path.glob("outputs/*/*")
    rank0 = (run_dir / "logs" / "rank0.stdout.log").read_text().splitlines()

    assert sum(line.startswith("[dsrun] peak (measured): ") and line.endswith(" TFLOP/s") for line in rank0) == 1
    progress = [line for line in rank0 if line.startswith("[dsrun] step ") and " | loss " in line]
    assert len(progress) == steps and all(" TFLOP/s | MFU " in line for line in progress)

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["peak_source"] == "measured" and metrics["peak_flops_per_device"] > 0
    assert metrics["model_flops_per_step"] == metrics["step_flops"]  # no activation checkpointing: no recompute
    assert 0 < metrics["mfu"] and math.isfinite(metrics["mfu"]) and metrics["tflops_per_device"] > 0

    with open(run_dir / "dsrun" / "Train_Samples_mfu.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "mfu"] and len(rows) == steps + 1
    assert all(float(value) > 0 for _, value in rows[1:])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "dsrun"))
    events.Reload()
    assert len(events.Scalars("Train/Samples/mfu")) == steps
    assert len(events.Scalars("Train/Samples/tflops_per_device")) == steps
