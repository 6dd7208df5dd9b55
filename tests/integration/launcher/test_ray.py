"""Ray Train starts the ranks (docs/cluster.md, "Ray"), on a real local Ray (``ray.init()`` on CPU, 2 workers):

* ``dsrun train launcher=ray launcher.num_procs=2 launcher.max_failures=2``, one of whose workers is killed (SIGKILL,
  by PID) once Ray has registered the step-5 checkpoint: Ray restarts the whole group, which resumes from the
  checkpoint Ray registered last (the run directory's own are moved away at the kill), trains the local launcher's
  losses (the same overrides, the worker's entry in two ranks: ``run_ranks``) and ends with its weights, bit for bit;
  the checkpoints dsrun saved are registered with Ray;
* without the package, ``launcher=ray`` is one line naming ``pip install 'dsrun[ray]'`` and exit code 2.

One Ray for the module, started here and shut down at the end; the ``dsrun train`` process joins it
(``launcher.address``). Every wait is bounded. (Your own ``TorchTrainer(dsrun.ray.train_loop)``: ``dsrun train``
builds one; ``prepare_run`` is tests/unit/launcher/test_ray_options.py's.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.helpers import REPO, run_cli, run_ranks

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
        "ds.train_micro_batch_size_per_gpu=2", "train.eval_iters=1", "train.eval_interval=0", "monitor=none",
        "scheduler.params.warmup_num_steps=2", "train.max_steps=20", "train.save_interval=5", "train.keep_last=2"]
TIMEOUT = 240
# Ray Train looks at its workers every 0.5 s (takes a report, notices a dead one: 2 s by default), and gives a
# worker group on a busy test machine 3 minutes to start (1 by default)
RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180"}


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray of this test process: 4 logical CPUs (2 workers and room for the restarted group)."""
    import ray

    # each worker takes 1 CPU, so Ray gives it one thread (OMP_NUM_THREADS=1), as the local baseline has below;
    # a value of this process's would reach the workers instead
    saved = {name: os.environ.pop(name, None) for name in ("OMP_NUM_THREADS", *RAY_ENV)}
    os.environ.update(RAY_ENV)  # the trainers started here hand it to their controllers
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model's weights in the run's last checkpoint (step 20)."""
    return torch.load(run_dir / "checkpoints" / "global_step20" / "mp_rank_00_model_states.pt",
                      weights_only=False)["module"]


def local_rank_run(rank: int, world_size: int, run_dir: Path) -> int:
    from dsrun import worker

    os.environ["OMP_NUM_THREADS"] = "1"  # a Ray worker's one thread (one CPU each)
    return worker.main(["--run-dir", str(run_dir)])


def local_launcher_losses(run_dir: Path) -> list[float]:
    """The same overrides on dsrun's own launcher: the run directory ``dsrun train`` writes, the worker's entry
    in two ranks."""
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run

    run_dir.mkdir(parents=True)
    write_run_files(run_dir, resolve_run(compose_runspec([*TINY, "launcher.num_procs=2"])))
    assert run_ranks(local_rank_run, 2, run_dir, timeout=TIMEOUT) == [0, 0]
    return json.loads((run_dir / "metrics.json").read_text())["train_losses"]


def ray_workers() -> list[int]:
    """PIDs of the Ray Train workers this test process's Ray started (its descendants only)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                if b"RayTrainWorker" in (Path("/proc") / str(child) / "cmdline").read_bytes():
                    found.append(child)
            except OSError:
                continue
    return found


def dsrun_train(*args: str, cwd: Path) -> subprocess.Popen:
    """``python -m dsrun ARGS`` started in the background (this checkout importable), its output in files."""
    env = {**os.environ, **RAY_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    with open(cwd / "stdout.txt", "w") as out, open(cwd / "stderr.txt", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "dsrun", *args], cwd=cwd, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)


def test_dsrun_train_on_ray_survives_a_killed_worker_with_the_local_launchers_losses_and_weights(ray_address,
                                                                                                 tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    process = dsrun_train("train", "launcher=ray", "launcher.num_procs=2", "launcher.max_failures=2",
                          f"launcher.address={ray_address}", *TINY, cwd=job)
    deadline, killed, run_dir = time.monotonic() + TIMEOUT, None, None
    try:
        while killed is None and time.monotonic() < deadline and process.poll() is None:
            # Ray rewrites its record of the registered checkpoints at each registration
            registered = list(job.glob("outputs/*/*/ray/checkpoint_manager_snapshot.json"))
            if registered and "global_step5" in registered[0].read_text():
                workers = ray_workers()
                if workers:
                    killed = workers[-1]
                    os.kill(killed, signal.SIGKILL)
                    # the run directory's own checkpoints out of the way: the new group finds Ray's, or none
                    run_dir = registered[0].parents[1]
                    (run_dir / "checkpoints").rename(run_dir / "checkpoints_before_the_kill")
            time.sleep(0.02)
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    output = (job / "stdout.txt").read_text()[-3000:] + (job / "stderr.txt").read_text()[-3000:]
    assert killed is not None, "the run ended before a worker could be killed\n" + output
    assert code == 0, output
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # the restarted group resumed from the checkpoint Ray had registered last when the worker died, not from step 0
    resumed = metrics.get("resumed_from_step")
    assert resumed in (5, 10, 15) and metrics["world_size"] == 2, resumed
    # the steps it trained again and after have the local launcher's losses, and the run ends with its weights: the
    # steps before the kill (which the restarted group does not record) had them too, or the weights would differ
    local = tmp_path / "local"
    losses = local_launcher_losses(local)
    assert metrics["train_losses"] == losses[resumed:]
    expected, final = final_weights(local), final_weights(run_dir)
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
    # every checkpoint dsrun saved was registered with Ray, which keeps the newest train.keep_last in its storage
    assert sorted(p.name for p in (run_dir / "ray").glob("global_step*")) == ["global_step15", "global_step20"]
    assert sorted(p.name for p in (run_dir / "ray" / "global_step20").iterdir()) == \
        sorted(p.name for p in (run_dir / "checkpoints" / "global_step20").iterdir())


def test_launcher_ray_without_the_package_is_one_line_and_exit_code_2(tmp_path):
    shim = tmp_path / "no_ray"
    shim.mkdir()
    (shim / "ray.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    done = run_cli("train", "launcher=ray", "launcher.num_procs=2", cwd=tmp_path,
                   env={"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == ["error: launcher.runner: is 'ray', but Ray is not installed (pip install 'dsrun[ray]')"], \
        done.stderr
    assert not list(tmp_path.glob("outputs/*/*")), "a run directory was written before the refusal"
