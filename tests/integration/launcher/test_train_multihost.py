"""`dsrun train` across two namespace hosts over ssh trains exactly as the same 4 ranks on one host: the worker's
per-rank entry (what dsrun's agent starts on each host) in 4 processes of this machine, in a run directory written
as `dsrun train` writes it, forked from the tests' preloaded server (``run_ranks``): no second launcher and no 4 fresh
torch imports (15 s of CPU with the server's own start, 26 s through `dsrun train`)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import free_port, run_ranks
from tests.integration.launcher.jobs import job_env, kill_job, new_tag, wait_until_gone

pytestmark = [pytest.mark.multihost]

SHORT = ["train.max_steps=4", "train.eval_interval=0", "train.eval_iters=1", "data.max_bytes=300000",
         "ds.train_micro_batch_size_per_gpu=4"]


def _losses(folder) -> list[float]:
    (metrics,) = folder.glob("**/metrics.json")
    data = json.loads(metrics.read_text())
    assert data["world_size"] == 4
    return data["train_losses"]


def one_host_rank(rank: int, world_size: int, run_dir) -> int:
    from dsrun import worker

    return worker.main(["--run-dir", str(run_dir)])


@pytest.mark.slow
def test_train_on_two_hosts_equals_one_host(two_hosts, tmp_path):
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run

    single = tmp_path / "single"
    single.mkdir()
    write_run_files(single, resolve_run(compose_runspec([*SHORT, "launcher.num_procs=4"])))
    assert run_ranks(one_host_rank, 4, single, timeout=300) == [0, 0, 0, 0]

    tag = new_tag()
    job_dir = two_hosts.job_dir(tmp_path)
    try:
        command = two_hosts.in_namespace(two_hosts.a, [
            sys.executable, "-m", "dsrun", "train", *SHORT, "launcher=ssh",
            f"launcher.hostfile={two_hosts.hostfile()}", f"launcher.launcher_args=-F {two_hosts.ssh_config}",
            f"launcher.master_port={free_port()}"])
        done = subprocess.run(command, env=job_env(tag, tmp_path), capture_output=True, text=True, timeout=300,
                              cwd=job_dir)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # ranks really ran on host B: the launcher prefixes B's relayed lines with its address (every rank warns
        # that 4 steps are fewer than the schedule's warm-up, on stderr)
        assert f"[{two_hosts.b.address}] [rank3]" in done.stdout + done.stderr
        assert _losses(job_dir) == pytest.approx(_losses(single), rel=1e-6, abs=0)
        assert wait_until_gone(tag, 10) == []
    finally:
        kill_job(tag)
