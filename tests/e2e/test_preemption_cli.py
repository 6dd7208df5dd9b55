"""A scheduler's signal to ``dsrun train`` itself (docs/cluster.md): SIGUSR1, Slurm's ``--signal=USR1@N``, sent to
the launcher only, reaches every rank through dsrun's agent; the ranks finish their step, save a checkpoint there
though train.save_interval=0, and ``dsrun train`` says where, how to resume, and exits with 138. (The exact resume
after five such preemptions: tests/integration/test_preemption.py.)"""
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from dsrun.checkpoint import read_latest
from tests.helpers import free_port, signal_when

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
        "ds.train_micro_batch_size_per_gpu=2", "train.eval_iters=1", "train.eval_interval=0", "monitor=none",
        "scheduler.params.warmup_num_steps=2", "train.max_steps=500", "ds.steps_per_print=1", "train.resume=auto"]


@pytest.mark.timeout(400)
def test_sigusr1_to_dsrun_train_saves_where_the_ranks_stop_and_exits_138(tmp_path):
    started = time.perf_counter()
    # to the launcher only: its agent and ranks hear of it from it
    code, out, err = signal_when(["train", *TINY, f"launcher.master_port={free_port()}"], tmp_path, "step 2/500",
                                 signal.SIGUSR1, group=False)
    (run_dir,) = tmp_path.glob("outputs/*/*")
    where = run_dir.relative_to(tmp_path)
    assert code == 138, out[-2000:] + err[-3000:]
    record = json.loads((run_dir / "preempted.json").read_text())
    step = record["step"]
    assert record["signal"] == "SIGUSR1" and record["saved"] and step >= 2  # at a step boundary after the signal
    assert read_latest(run_dir / "checkpoints") == f"global_step{step}"  # though train.save_interval=0
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == step
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"[dsrun] stopped by SIGUSR1 after step {step} of 500; checkpoint saved at step {step} in "
                     f"{where / 'checkpoints' / f'global_step{step}'}",
                     f"[dsrun] resume: dsrun train --from {where} (or the same command with train.resume=auto)",
                     "[dsrun] exit code 138: preempted, checkpoint saved where the ranks stopped (requeue the job)"
                     ], err
    assert _left_running(tmp_path) == []  # the launcher waited for its agent, the agent for the ranks
    sys.stdout.write(f"one preempted launch: {time.perf_counter() - started:.1f} s\n")


def _left_running(folder: Path) -> list[int]:
    """PIDs of processes still running in ``folder`` (the launcher's agent and ranks run there)."""
    left = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if cwd.resolve() == folder.resolve():
                left.append(int(cwd.parent.name))
        except OSError:
            continue
    return left
