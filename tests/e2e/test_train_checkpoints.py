"""`dsrun train` with checkpoints: save every train.save_interval steps, keep train.keep_last, and a new launch
with train.resume=<run dir> continues exactly where the first stopped (same losses, bit for bit)."""
import json
from pathlib import Path

import pytest

from dsrun.checkpoint import list_tags, read_latest
from tests.helpers import free_port, run_cli

QUICK = ["train.eval_iters=1", "train.eval_interval=0", "data.max_bytes=300000"]


def train(cwd: Path, *overrides: str) -> tuple[dict, Path]:
    cwd.mkdir(parents=True, exist_ok=True)
    # a free master port: other dsrun jobs on this machine may hold the default 29500
    result = run_cli("train", *QUICK, f"launcher.master_port={free_port()}", *overrides, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (metrics_path,) = cwd.glob("outputs/*/*/metrics.json")
    return json.loads(metrics_path.read_text()), metrics_path.parent


@pytest.mark.slow
def test_save_interval_keep_last_and_exact_resume(tmp_path):
    full, run_dir = train(tmp_path / "full", "train.max_steps=8", "train.save_interval=2", "train.keep_last=3")
    ckpts = run_dir / "checkpoints"
    assert read_latest(ckpts) == "global_step8"
    assert list_tags(ckpts) == ["global_step4", "global_step6", "global_step8"]  # keep_last=3 pruned step 2
    assert (ckpts / "zero_to_fp32.py").is_file()

    resumed, _ = train(tmp_path / "second", "train.max_steps=8", f"train.resume={ckpts / 'global_step4'}")
    assert resumed["resumed_from_step"] == 4
    assert resumed["train_losses"] == full["train_losses"][4:]  # model, optimizer, LR, RNG and data position


@pytest.mark.slow
def test_resume_from_a_missing_checkpoint_is_a_user_error(tmp_path):
    result = run_cli("train", *QUICK, "train.max_steps=1", f"train.resume={tmp_path / 'nothing'}",
                     f"launcher.master_port={free_port()}", cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    assert "train.resume: no checkpoint at" in result.stdout + result.stderr
