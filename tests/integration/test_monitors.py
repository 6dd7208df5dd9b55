"""Acceptance for observability on two ranks: a real ``dsrun train`` with every monitor on, read back with
each tool's own reader; and the comms summary against the engine's per-step accounting."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers import free_port, run_cli, run_ranks


def _csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


@pytest.mark.slow  # two ranks train for a few steps; MLflow's first store takes ~15 s to create
def test_two_rank_run_with_every_monitor(tmp_path):
    steps, micro, seq = 4, 2, 32
    result = run_cli("train", "monitor=all", "launcher.num_procs=2", f"launcher.master_port={free_port()}",
                     f"train.max_steps={steps}",
                     "train.eval_interval=2", "train.eval_iters=1", "ds.steps_per_print=2",
                     f"ds.train_micro_batch_size_per_gpu={micro}", "ds.gradient_accumulation_steps=1",
                     f"data.seq_len={seq}", "ds.wall_clock_breakdown=true", "+ds.comms_logger.enabled=true",
                     "+ds.flops_profiler.enabled=true", "+ds.mlflow.run_name=acceptance",
                     cwd=tmp_path, env={"OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": ""}, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = next((tmp_path / "outputs").glob("*/*"))
    job = run_dir / "dsrun"
    global_batch = micro * 2

    # CSV: DeepSpeed's names, headers, and one row per step keyed by global samples
    header, loss_rows = _csv(job / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in loss_rows] == [global_batch * k for k in range(1, steps + 1)]
    assert [s for s, _ in _csv(job / "Train_Samples_lr.csv")[1]] == [s for s, _ in loss_rows]
    assert [s for s, _ in _csv(job / "Train_Samples_elapsed_time_ms_forward.csv")[1]] == [2 * global_batch,
                                                                                          4 * global_batch]
    for name in ("Eval_Samples_eval_loss", "Train_Samples_tokens_per_second", "Train_Samples_samples_per_second",
                 "Train_Samples_tflops"):
        assert _csv(job / f"{name}.csv")[1], name
    assert not any((run_dir / "dsrun").glob("*rank1*"))

    # TensorBoard: the same scalars, through TensorBoard's own loader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(job))
    acc.Reload()
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars("Train/Samples/train_loss")] == \
        [(s, v) for s, v in loss_rows]
    csv_tags = {p.stem for p in job.glob("*.csv")}
    assert {t.replace("/", "_").replace(" ", "_") for t in acc.Tags()["scalars"]} == csv_tags

    # MLflow: a run with the flattened RunSpec, the metrics and the run's files, in a local store
    from mlflow.tracking import MlflowClient

    assert (tmp_path / "mlruns" / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dsrun")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "acceptance" and run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == str(steps)
    assert run.data.params["ds.train_micro_batch_size_per_gpu"] == str(micro)
    assert run.data.params["model._target_"] == "dsrun.models.gpt.GPT"
    history = client.get_metric_history(run.info.run_id, "Train/Samples/train_loss")
    assert [(m.step, pytest.approx(m.value, rel=1e-6)) for m in history] == [(s, v) for s, v in loss_rows]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"resolved.yaml", "ds_config.json", "metrics.json", "comms.json", "flops_profile.txt"} <= artifacts

    # the reports in the run directory, and the console
    comms = json.loads((run_dir / "comms.json").read_text())
    assert comms["world_size"] == 2 and comms["ops"]
    assert "DeepSpeed Flops Profiler" in (run_dir / "flops_profile.txt").read_text()
    rank0 = (run_dir / "logs" / "rank0.stdout.log").read_text()
    assert "Comm. Op            Message Size" in rank0
    assert f"[dsrun] step {steps}/{steps} | loss " in rank0  # plain lines: the log is not a terminal


def _comms_rank(rank: int, world_size: int) -> dict:
    import torch

    import dsrun
    from dsrun import comm
    from tests.harness.models import MLP, MLP_IN, MLP_OUT

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 200},
              "comms_logger": {"enabled": True}}
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    comm.reset_comms_stats()
    accounted: dict[str, dict[str, float]] = {}
    engine._comm_at_step_start = comm.get_comms_stats()  # the window starts at the reset
    for _ in range(3):
        for _ in range(2):
            engine.backward(engine((torch.randn(4, MLP_IN), torch.randn(4, MLP_OUT))))
            engine.step()
        for op, stats in engine.comm_stats_last_step().items():
            total = accounted.setdefault(op, {"count": 0, "message_bytes": 0})
            total["count"] += stats["count"]
            total["message_bytes"] += stats["message_bytes"]
    summary = comm.log_summary(show_straggler=True)
    return {"accounted": accounted, "summary": summary}


@pytest.mark.slow  # two spawned ranks: ~20-45 s on a shared machine
@pytest.mark.timeout(200)
def test_comms_summary_equals_the_engines_accounting():
    results = run_ranks(_comms_rank, 2, timeout=180)
    for result in results:
        accounted, summary = result["accounted"], result["summary"]
        assert accounted, "ZeRO-2 on two ranks communicates"
        assert {op: {"count": e["count"], "message_bytes": e["message_bytes"]}
                for op, e in summary.items()} == accounted
        for op, entry in summary.items():
            rows = entry["sizes"]
            assert sum(r["count"] for r in rows) == entry["count"]
            assert sum(r["count"] * r["message_bytes"] for r in rows) == entry["message_bytes"]
            assert all(r["timed_calls"] == r["count"] for r in rows)  # logged ops are all timed
            assert sum(r["count"] for r in entry["straggler"]) == entry["count"]
