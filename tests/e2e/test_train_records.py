"""What a run leaves behind when it does not simply finish: Ctrl-C says where it stopped, what was saved and
how to resume (and --from resumes it; train.resume=auto finds it); the MLflow run of a stopped job is KILLED,
of a failed one FAILED, also for a trial of an Optuna sweep; provenance.json records what ran."""
import json
import platform
import signal
from pathlib import Path

import pytest

from dsrun.checkpoint import read_latest
from tests.helpers import free_port, run_cli, signal_when

QUICK = ["train.eval_iters=1", "train.eval_interval=0", "data.max_bytes=300000", "monitor=mlflow",
         "scheduler.params.warmup_num_steps=2"]
MLFLOW = {"MLFLOW_TRACKING_URI": ""}


def interrupt_when(args: list[str], cwd: Path, seen: str, timeout: float = 300) -> tuple[int, str, str]:
    """Run ``python -m dsrun ARGS`` in its own session and, once ``seen`` appears on its stdout, send SIGINT to
    the whole process group, as Ctrl-C in a terminal does. Returns (exit code, stdout, stderr)."""
    return signal_when(args, cwd, seen, signal.SIGINT, group=True, env=MLFLOW, timeout=timeout)


def mlflow_statuses(cwd: Path, experiment: str = "dsrun") -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlruns' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {run.info.run_name: run.info.status for run in runs}


@pytest.mark.slow  # three launches of the default recipe
@pytest.mark.timeout(900)
def test_ctrl_c_says_what_was_saved_and_from_resumes_it(tmp_path):
    args = ["train", *QUICK, "train.max_steps=200", "train.save_interval=1000", "ds.steps_per_print=1",
            f"launcher.master_port={free_port()}"]
    code, out, err = interrupt_when(args, tmp_path, "step 3/200")
    (run_dir,) = tmp_path.glob("outputs/*/*")
    where = run_dir.relative_to(tmp_path)
    assert code == 130, out[-2000:] + err[-3000:]
    step = json.loads((run_dir / "metrics.json").read_text())["steps"]  # the ranks stop at a step boundary
    assert step >= 3
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"[dsrun] stopped by Ctrl-C after step {step} of 200; checkpoint saved at step {step} in "
                     f"{where / 'checkpoints' / f'global_step{step}'}",
                     f"[dsrun] resume: dsrun train --from {where}"], err  # no torch elastic noise, no traceback
    assert lines[0] in (run_dir / "dsrun.log").read_text()
    assert mlflow_statuses(tmp_path) == {f"{run_dir.parent.name}/{run_dir.name}": "KILLED"}

    resumed = run_cli("train", "--from", str(where), f"train.max_steps={step + 2}", f"launcher.master_port={free_port()}",
                      cwd=tmp_path, timeout=600, env=MLFLOW)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"[dsrun] resuming {run_dir} from its checkpoint global_step{step} at step {step} (of {step + 2} steps)" \
        in resumed.stdout
    (second,) = [p for p in tmp_path.glob("outputs/*/*") if p != run_dir]
    metrics = json.loads((second / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == step and metrics["steps"] == 2
    assert mlflow_statuses(tmp_path)[f"{second.parent.name}/{second.name}"] == "FINISHED"

    record = json.loads((second / "provenance.json").read_text())
    import dsrun
    import torch

    assert (record["dsrun"], record["torch"], record["python"]) == (dsrun.__version__, torch.__version__,
                                                                    platform.python_version())
    first_record = json.loads((run_dir / "provenance.json").read_text())
    assert record["data"] == first_record["data"] and record["data"]["how"] == "full"  # the same tokens
    assert f"train.max_steps={step + 2}" in record["overrides"] and "monitor=mlflow" in record["overrides"]

    # the resumed run saved at its last step (no multiple of train.save_interval=1000), and train.resume=auto
    # with the same recipe and overrides finds that checkpoint, the newest
    assert read_latest(second / "checkpoints") == f"global_step{step + 2}"
    auto = run_cli("train", "--dry-run", *QUICK, "train.max_steps=400", "train.resume=auto", cwd=tmp_path,
                   env=MLFLOW)
    assert auto.returncode == 0, auto.stderr
    assert (f"resume          train.resume=auto: resuming from {second / 'checkpoints' / f'global_step{step + 2}'} "
            f"at step {step + 2}") in auto.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_rank_dies_is_failed_in_mlflow(tmp_path):
    result = run_cli("train", *QUICK, "train.max_steps=3", "train.save_interval=1", f"launcher.master_port={free_port()}",
                     cwd=tmp_path, timeout=500, env={**MLFLOW, "DSRUN_TEST_CRASH_AT": "after_optim_states",
                                                     "DSRUN_TEST_CRASH_RANK": "1"})
    assert result.returncode == 128 + signal.SIGKILL, result.stderr[-3000:]
    assert "[dsrun] training failed (exit code 137)" in result.stderr
    (run_dir,) = tmp_path.glob("outputs/*/*")
    assert mlflow_statuses(tmp_path) == {f"{run_dir.parent.name}/{run_dir.name}": "FAILED"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_in_an_optuna_sweep_kills_the_trial_that_ran_and_stops_the_sweep(tmp_path):
    args = ["train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", *QUICK, "train.max_steps=200",
            "ds.steps_per_print=1", "launcher.num_procs=1", "optimizer.params.lr=tag(log, interval(1e-4, 1e-2))"]
    code, out, err = interrupt_when(args, tmp_path, "step 2/200")
    assert code == 130, out[-2000:] + err[-3000:]
    (job,) = (tmp_path / "multirun").glob("*/*/0")
    assert not list((tmp_path / "multirun").glob("*/*/1"))  # the sweep stopped with its first trial
    statuses = mlflow_statuses(tmp_path)
    assert statuses[f"{job.parent.name}/{job.name}"] == "KILLED", statuses
