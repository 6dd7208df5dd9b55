"""Progress output (a bar on a terminal, plain lines elsewhere) and where a run's monitors write by default."""
from __future__ import annotations

import io

from dsrun.monitor.progress import TrainingProgress
from dsrun.monitor.run_defaults import PARENT_ENV, apply_run_defaults, flatten, mlflow_parent_key


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_every_print_every_steps_and_at_the_end(monkeypatch):
    monkeypatch.delenv("DSRUN_PROGRESS", raising=False)
    out = io.StringIO()
    progress = TrainingProgress(5, print_every=2, stream=out)
    for step in range(1, 6):
        progress.update(step, 2.0 / step, 1e-3, 40.0, 5120.0, elapsed_s=step * 0.5,
                        extra="eval 1.5" if step == 4 else "")
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["[dsrun] step 2/5", "[dsrun] step 4/5", "[dsrun] step 5/5"]
    assert lines[1] == ("[dsrun] step 4/5 | loss 0.5000 | lr 1.000e-03 | 40 samples/s | 5,120 tokens/s | eta 0s"
                        " | eval 1.5")


def test_rich_bar_on_a_terminal_and_silence_off_rank_0(monkeypatch):
    monkeypatch.delenv("DSRUN_PROGRESS", raising=False)
    term = _Terminal()
    progress = TrainingProgress(3, stream=term)
    assert progress.use_bar
    for step in range(1, 4):
        progress.update(step, 1.25, 3e-4, 10.0, 1280.0, elapsed_s=step)
    progress.note("[dsrun] eval 1.1")
    progress.close()
    text = term.getvalue()
    assert "3/3" in text and "loss 1.2500" in text and "1,280 tokens/s" in text and "[dsrun] eval 1.1" in text
    quiet = io.StringIO()
    other = TrainingProgress(3, enabled=False, stream=quiet)
    other.update(3, 1.0, 1e-3, 1.0, 1.0, 1.0)
    other.note("x")
    assert quiet.getvalue() == ""
    monkeypatch.setenv("DSRUN_PROGRESS", "bar")
    forced = TrainingProgress(3, stream=io.StringIO())
    forced.close()
    assert forced.use_bar  # a launcher relaying rank 0 to a terminal asks for the bar
    monkeypatch.setenv("DSRUN_PROGRESS", "lines")
    assert not TrainingProgress(3, stream=_Terminal()).use_bar


def test_run_defaults_put_outputs_in_the_run_dir_and_mlflow_beside_the_outputs(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "hydra.yaml").write_text(
        f"hydra:\n  mode: RUN\n  runtime:\n    cwd: {tmp_path}\n  sweep:\n    dir: multirun/${{now:%Y}}\n")
    ds = {"csv_monitor": {"enabled": True, "output_path": ""}, "tensorboard": {"enabled": True},
          "mlflow": {"enabled": True}}
    out = apply_run_defaults(ds, run_dir)
    assert out["csv_monitor"]["output_path"] == str(run_dir) == out["tensorboard"]["output_path"]
    assert out["mlflow"]["tracking_uri"] == f"sqlite:///{tmp_path.resolve()}/mlruns/mlflow.db"
    assert out["mlflow"]["run_name"] == "2026-01-01/12-00-00"
    assert ds["csv_monitor"]["output_path"] == ""  # the caller's dict is left alone
    kept = apply_run_defaults({"csv_monitor": {"enabled": True, "output_path": "/elsewhere"}}, run_dir)
    assert kept["csv_monitor"]["output_path"] == "/elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://server:5000")
    assert "tracking_uri" not in apply_run_defaults({"mlflow": {"enabled": True}}, run_dir)["mlflow"]
    assert mlflow_parent_key(run_dir) is None


def test_multirun_jobs_share_a_parent_key(tmp_path, monkeypatch):
    monkeypatch.delenv(PARENT_ENV, raising=False)
    keys = set()
    for job in ("0", "1"):
        run_dir = tmp_path / "multirun" / "2026-01-01" / "12-00-00" / job
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "hydra.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
        keys.add(mlflow_parent_key(run_dir))
    assert keys == {str((tmp_path / "multirun" / "2026-01-01" / "12-00-00").resolve())}
    monkeypatch.setenv(PARENT_ENV, "study-7")
    assert mlflow_parent_key(run_dir) == "study-7"


def test_flatten_gives_dotted_keys():
    assert flatten({"model": {"n_layer": 2, "dims": [1, 2]}, "seed": 3}) == {"model.n_layer": 2, "model.dims": [1, 2],
                                                                            "seed": 3}
