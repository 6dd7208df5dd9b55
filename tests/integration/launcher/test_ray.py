"""Ray Train starts the ranks (docs/cluster.md, "Ray"), on a real local Ray (CPU, 2 workers):

* your own ``TorchTrainer(dsrun.ray.train_loop)`` (the run prepared by ``dsrun.ray.prepare_run``) with
  ``FailureConfig(max_failures=2)``, one of whose workers is killed (SIGKILL, by PID) once Ray has registered the
  step-5 checkpoint: Ray restarts the whole group, which resumes from the checkpoint Ray registered last (the run
  directory's own are moved away at the kill), trains the local launcher's losses (the same overrides, the worker's
  entry in two ranks: ``run_ranks``) and ends with its weights, bit for bit;
* a real node drain under ``dsrun train launcher=ray launcher.max_failures=0 launcher.max_preemption_failures=1``:
  its 2 workers run on a second node of the Ray, which Ray's GCS is asked to drain for preemption with a deadline
  (``DrainNode``, what ``ray drain-node`` and the autoscaler send) while they begin step 7: both ranks stop at that
  step's boundary and save, the checkpoint is registered with Ray, Ray ends the group at the deadline and starts it
  again on the head, from that checkpoint, though ``max_failures=0``: a preemption is not a failure; the run ends
  with exit code 0, the local launcher's losses and weights, Ray's storage holds the newest ``train.keep_last`` of
  dsrun's checkpoints, and the drained node leaves the cluster;
* without the package, ``launcher=ray`` is one line naming ``pip install 'dsrun[ray]'`` and exit code 2.

One Ray for the module (``ray.cluster_utils.Cluster``: its head node, 4 logical CPUs; the drain test adds a node of
2 and removes it), started here and shut down at the end; the ``dsrun train`` process joins it
(``launcher.address``). The local launcher's run, the reference, is made once for both. Every wait is bounded.
(``prepare_run``'s checks and ``launcher=ray``'s keys are tests/unit/launcher/test_ray_options.py's.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import pytest
import torch

from tests.helpers import REPO, run_cli, run_ranks

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
        "ds.train_micro_batch_size_per_gpu=2", "train.eval_iters=1", "train.eval_interval=0", "monitor=none",
        "scheduler.params.warmup_num_steps=2", "train.max_steps=20", "train.save_interval=5", "train.keep_last=2"]
TIMEOUT = 240
HEAD_CPUS = 4  # the module's Ray: 2 workers and room for the restarted group
# Ray Train looks at its workers every 0.5 s (takes a report, notices a dead one: 2 s by default) and at the nodes
# being drained as often (5 s by default), and gives a worker group on a busy test machine 3 minutes to start (1 by
# default)
RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180"}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """A local Ray of this test process: a head node of 4 logical CPUs (2 workers and room for the restarted group),
    this process its driver."""
    import ray
    from ray.cluster_utils import Cluster

    # each worker takes 1 CPU, so Ray gives it one thread (OMP_NUM_THREADS=1), as the local baseline has below;
    # a value of this process's would reach the workers instead. The workers import this checkout (the drain
    # test's worker function is this module's)
    saved = {name: os.environ.pop(name, None) for name in ("OMP_NUM_THREADS", "PYTHONPATH", *RAY_ENV)}
    os.environ.update(RAY_ENV)  # the trainers started here hand it to their controllers
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved["PYTHONPATH"]]))
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": HEAD_CPUS, "include_dashboard": False})
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The local launcher's losses and final weights for TINY (the reference of both Ray runs)."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    return local_launcher_losses(run_dir), final_weights(run_dir)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model's weights in the run's last checkpoint (step 20)."""
    return torch.load(run_dir / "checkpoints" / "global_step20" / "mp_rank_00_model_states.pt",
                      weights_only=False)["module"]


def assert_resumed_exactly(run_dir: Path, resumed: int, local_run: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    """The run in ``run_dir`` was resumed on 2 ranks from step ``resumed``, trained the local launcher's losses from
    there and ends with its final weights, bit for bit (so the steps before, which it does not record, had them
    too, or the weights would differ)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics.get("resumed_from_step"), metrics["world_size"]) == (resumed, 2)
    losses, expected = local_run
    assert metrics["train_losses"] == losses[resumed:]
    final = final_weights(run_dir)
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name


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


def test_your_own_trainer_of_train_loop_survives_a_killed_worker_with_the_local_launchers_losses_and_weights(
        ray_cluster, local_run, tmp_path):
    """``TorchTrainer(dsrun.ray.train_loop)`` with ``FailureConfig(max_failures=2)``, the run prepared by
    ``dsrun.ray.prepare_run``: one worker killed once Ray registered the step-5 checkpoint, the group restarted from
    Ray's checkpoint (the run directory's own are moved away)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import dsrun.ray

    config = dsrun.ray.prepare_run(TINY, num_workers=2, run_dir=tmp_path / "run")
    run_dir = Path(config[dsrun.ray.RUN_DIR_KEY])
    trainer = TorchTrainer(dsrun.ray.train_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="killed", storage_path=str(tmp_path / "ray"),
                                                failure_config=FailureConfig(max_failures=2)))
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # handed to the test's thread
            outcome["error"] = err

    fitting = threading.Thread(target=fit, daemon=True)  # this process is Ray's driver
    fitting.start()
    # Ray rewrites its record of the registered checkpoints at each registration
    registered = tmp_path / "ray" / "killed" / "checkpoint_manager_snapshot.json"
    deadline, killed = time.monotonic() + TIMEOUT, None
    while killed is None and time.monotonic() < deadline and fitting.is_alive():
        if registered.exists() and "global_step5" in registered.read_text():
            workers = ray_workers()
            if workers:
                killed = workers[-1]
                os.kill(killed, signal.SIGKILL)
                # the run directory's own checkpoints out of the way: the new group finds Ray's, or none
                (run_dir / "checkpoints").rename(run_dir / "checkpoints_before_the_kill")
        time.sleep(0.02)
    fitting.join(timeout=max(1.0, deadline - time.monotonic()))
    assert not fitting.is_alive(), "the run did not end"
    assert killed is not None, "the run ended before a worker could be killed"
    assert "error" not in outcome, outcome.get("error")
    # the restarted group resumed from the checkpoint Ray had registered last when the worker died, not from step 0
    resumed = json.loads((run_dir / "metrics.json").read_text()).get("resumed_from_step")
    assert resumed in (5, 10, 15), resumed
    assert_resumed_exactly(run_dir, resumed, local_run)
    assert outcome["result"].error is None and outcome["result"].metrics["step"] == 20


# the drain test: the step whose boundary the drain's notice reaches; the drain's deadline, which must cover Ray's
# notice reaching the ranks, that step, the save and Ray's registration of the checkpoint (0.4 to 0.7 s after the
# drain under load averages of 11 to 21 on the 2-core test machine). Ray ends the group only once it passed (a node
# that died before it would be a failure to Ray), so the workers wait for it
DRAIN_AT = 7
DRAIN_DEADLINE_S = 10
# on the drained node only: its Python processes run this folder's sitecustomize, the ranks' notes and their hold at
# step DRAIN_AT until Ray's notice came (the only thing the test adds to the workers: it fixes the step the drain
# lands on, so that the test can name it)
HOLD = Path(__file__).parent / "ray_hold"


def read_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = run_dir / f"events_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_dsrun_train_on_ray_a_drained_nodes_ranks_save_at_one_step_and_ray_restarts_them_on_the_head(
        ray_cluster, local_run, tmp_path):
    """``dsrun train launcher=ray launcher.max_failures=0 launcher.max_preemption_failures=1`` on two nodes: the
    module's head and one added here. The head's CPUs are held (a placement group of this test) until the drain, so
    the group starts on the added node; Ray is asked to drain that one (``DrainNode``, what ``ray drain-node`` and
    the autoscaler send) while the ranks begin step 7, and the group it restarts can only go to the head."""
    import ray
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2
    from ray.util.placement_group import placement_group, remove_placement_group

    spot = ray_cluster.add_node(num_cpus=2, env_vars={
        "PYTHONPATH": os.pathsep.join([str(HOLD), os.environ["PYTHONPATH"]]), "DSRUN_TEST_HOLD_AT": str(DRAIN_AT)})
    held = placement_group([{"CPU": HEAD_CPUS}])  # only the head has as many
    job = tmp_path / "job"
    job.mkdir()
    process = None
    try:
        ray.get(held.ready(), timeout=60)
        process = dsrun_train("train", "launcher=ray", "launcher.num_procs=2", "launcher.max_failures=0",
                              "launcher.max_preemption_failures=1", f"launcher.address={ray_cluster.address}", *TINY,
                              cwd=job)
        started = time.time()
        until = time.monotonic() + TIMEOUT
        while not any(e["event"] == "waiting" for path in job.glob("outputs/*/*")
                      for e in read_events(path, 0)) and process.poll() is None:
            assert time.monotonic() < until, "the workers did not reach the step to drain at"
            time.sleep(0.1)
        (run_dir,) = job.glob("outputs/*/*")
        # the drain Ray's autoscaler (and `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`) asks of the GCS
        drained_at = time.time()
        accepted, why = GcsClient(address=ray_cluster.address).drain_node(
            spot.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "the drain test: a spot reclaim", int((drained_at + DRAIN_DEADLINE_S) * 1000))
        assert accepted, why
        remove_placement_group(held)  # room for the restarted group on the head
        held = None
        code = process.wait(timeout=max(1.0, until + DRAIN_DEADLINE_S - time.monotonic()))
        ended = time.time()
        # the drained node leaves the cluster by itself once nothing runs on it (its raylet exits)
        while time.monotonic() < until and next(n for n in ray.nodes() if n["NodeID"] == spot.node_id)["Alive"]:
            time.sleep(0.2)
        drained_node_left = not next(n for n in ray.nodes() if n["NodeID"] == spot.node_id)["Alive"]
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        if held is not None:
            remove_placement_group(held)
        ray_cluster.remove_node(spot)
    output = (job / "stdout.txt").read_text()[-3000:] + (job / "stderr.txt").read_text()[-3000:]
    # Ray took the restart for a preemption, not a failure (max_failures=0), and the run for finished
    assert code == 0, output

    events = [read_events(run_dir, rank) for rank in (0, 1)]
    # the first group ran on the drained node (the only one noting: the hold is that node's); Ray's notice stopped
    # both ranks at the boundary of the same step, where each saved (each rank's record: the checkpoint at that
    # step, saved, the notice naming the node and ranks)
    for rank in (0, 1):
        assert [(e["node"], e["restored"]) for e in events[rank] if e["event"] == "start"] == [(spot.node_id, None)]
        stops = [e for e in events[rank] if e["event"] == "stopped"]
        assert [e["step"] for e in stops] == [DRAIN_AT], events
        record = stops[0]["record"]
        assert {k: record[k] for k in ("step", "saved", "checkpoint", "reached_boundary")} == \
            {"step": DRAIN_AT, "saved": True, "checkpoint": f"global_step{DRAIN_AT}", "reached_boundary": True}, record
        assert record["notice"].startswith(f"Ray: node(s) {spot.node_id[:12]} drained (ranks 0, 1; reclaimed at "), \
            record
    # the group Ray restarted (on the head: the drained node takes no new work and left) resumed from that
    # checkpoint, which Ray registered (it hands a restarted group the one it registered last), and ends with the
    # local launcher's losses and weights
    assert drained_node_left
    assert_resumed_exactly(run_dir, DRAIN_AT, local_run)
    # every checkpoint dsrun saved was registered with Ray, which keeps the newest train.keep_last in its storage
    assert sorted(p.name for p in (run_dir / "ray").glob("global_step*")) == ["global_step15", "global_step20"]
    assert sorted(p.name for p in (run_dir / "ray" / "global_step20").iterdir()) == \
        sorted(p.name for p in (run_dir / "checkpoints" / "global_step20").iterdir())
    at = {e["event"]: e["time"] for e in events[0]}
    sys.stdout.write(f"the drain test: step {DRAIN_AT} begun {at['waiting'] - started:.1f} s after dsrun train "
                     f"started; the ranks stopped and saved {at['stopped'] - drained_at:.1f} s after the drain "
                     f"(deadline {DRAIN_DEADLINE_S} s), dsrun train ended {ended - drained_at:.1f} s after it\n")


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
