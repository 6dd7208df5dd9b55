"""Two-node jobs on a real two-node Slurm, each node's ``srun`` task one rank of ``dsrun train`` (the outer-launcher
contract: srun's variables, the step's first node as the rendezvous address, docs/cluster.md "Slurm"), both with
``launcher.num_nodes=2 launcher.num_procs=1``: the batch script ``dsrun export-job --target sbatch`` writes, under
``sbatch``, and a one-job sweep ``dsrun train -m hydra/launcher=submitit_slurm``. Each trains the per-step losses of
``dsrun train launcher.num_procs=2`` with the same overrides (the worker's per-rank entry in two ranks,
``run_ranks``, in a run directory written as ``dsrun train`` writes it, computed here while Slurm runs both jobs,
side by side); rank 0 wrote the run files, in the job's one run directory; Slurm ran the job on both nodes.

The cluster (docs/cluster.md, "Slurm in the tests"): two machines made of network namespaces joined by a veth pair
(tests/namespaces.py), ``node1`` at 10.213.78.1 and ``node2`` at 10.213.78.2, each with its own host name and an
``/etc/hosts`` naming both; a ``slurmd`` on each (its own spool folder, pid file and log), ``slurmctld`` on node1,
one ``munged`` on this machine whose socket both reach. The jobs are submitted from node1. Started for this module,
stopped at its end (jobs, then daemons by PID, then the namespaces by name).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.slurm.cluster import SLURM_GROUP, Node, SlurmCluster, missing_programs, start_cluster
from tests.helpers import REPO, require_programs, run_ranks
from tests.namespaces import require_namespace_programs, veth_pair

# the Slurm tests' worker (one Slurm job at a time on this machine)
pytestmark = pytest.mark.xdist_group(SLURM_GROUP)

SUBNET = "10.213.78"  # the multi-host tests' pair is 10.213.77
STEPS = 10
OVERRIDES = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
             "ds.train_micro_batch_size_per_gpu=2", "train.eval_iters=1", "train.eval_interval=0", "monitor=none",
             "scheduler.params.warmup_num_steps=2", f"train.max_steps={STEPS}", "zero=stage1"]
TIMEOUT = 300
NODES = ["launcher.num_nodes=2", "launcher.num_procs=1"]  # one rank on each node


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    if missing_programs():
        require_programs(*missing_programs())  # skips, naming the packages
    require_namespace_programs()
    if os.geteuid() != 0:
        pytest.skip("the two-node Slurm runs its nodes in network namespaces and its daemons as root: run as root")
    folder = tmp_path_factory.mktemp("slurm2")
    with veth_pair(SUBNET, label="dsrun-slurm") as hosts:
        names = [f"node{index + 1}" for index in range(len(hosts))]
        hosts_file = folder / "hosts"  # every node's /etc/hosts: this machine's, and the nodes by name
        hosts_file.write_text(Path("/etc/hosts").read_text().rstrip("\n") + "\n"
                              + "".join(f"{host.address} {name}\n" for host, name in zip(hosts, names)))
        nodes = [Node(name, host.address, tuple(host.machine(name, hosts_file))) for host, name in zip(hosts, names)]
        cluster = start_cluster(folder / "cluster", nodes, cpus=2)
        try:
            yield cluster
        finally:
            cluster.stop()


def own_rank(rank: int, world_size: int, run_dir: Path) -> int:
    from dsrun import worker

    return worker.main(["--run-dir", str(run_dir)])


def own_losses(run_dir: Path) -> list[float]:
    """``dsrun train launcher.num_procs=2`` with the same overrides: its run directory as ``dsrun train`` writes
    it, the worker's entry in two ranks; the per-step losses."""
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run

    run_dir.mkdir()
    write_run_files(run_dir, resolve_run(compose_runspec([*OVERRIDES, "launcher.num_procs=2"])))
    assert run_ranks(own_rank, 2, run_dir, timeout=TIMEOUT) == [0, 0]
    return json.loads((run_dir / "metrics.json").read_text())["train_losses"]


def export_script(script: Path, runs: Path) -> None:
    """``dsrun export-job --target sbatch`` in this process (its imports are this process's already)."""
    from dsrun.cli.__main__ import main

    code = main(["export-job", "--target", "sbatch", "--runs-dir", str(runs), "--time", "10", "--name", "two-nodes",
                 "-o", str(script), *NODES, *OVERRIDES])
    assert code == 0


@dataclass
class Ended:
    """A command that ran while the reference trained: its exit code, its output, its folder, its wall time."""

    code: int
    out: str
    folder: Path
    seconds: float


def start(argv: list[str], folder: Path, env: dict[str, str]) -> subprocess.Popen:
    folder.mkdir()
    with open(folder / "out.txt", "w") as out:  # a file: a pipe nobody reads could fill
        return subprocess.Popen(argv, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)


@dataclass
class TwoNodeJobs:
    expected: list[float]  # dsrun train launcher.num_procs=2's losses
    sbatch: Ended          # sbatch --wait of the exported script
    sweep: Ended           # dsrun train -m hydra/launcher=submitit_slurm


@pytest.fixture(scope="module")
def two_node_jobs(two_node_cluster, tmp_path_factory) -> TwoNodeJobs:
    """Both two-node jobs, side by side (each takes one CPU of each node): the exported script under ``sbatch
    --wait`` (which returns once the job ended, with its exit code) and a one-job sweep on ``submitit_slurm``, both
    submitted from node1; meanwhile the reference trains here."""
    cluster = two_node_cluster
    folder = tmp_path_factory.mktemp("two_node_jobs")
    script = folder / "job.sh"
    export_script(script, folder / "runs")
    env = cluster.env({**os.environ, "OMP_NUM_THREADS": "1",  # a rank of dsrun's own on 2 ranks x 1 core
                       "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    cluster.wait_idle()
    started = time.perf_counter()
    processes = {"sbatch": start(cluster.client("sbatch", "--wait", "--parsable", str(script)), folder / "sbatch",
                                 env),
                 "sweep": start(cluster.client(sys.executable, "-m", "dsrun", "train", "-m",
                                               "hydra/launcher=submitit_slurm", *NODES, *OVERRIDES),
                                folder / "sweep", env)}
    ended = {}
    try:
        expected = own_losses(folder / "own")  # while Slurm runs the jobs
        for name, process in processes.items():
            code = process.wait(timeout=max(1.0, started + TIMEOUT - time.perf_counter()))
            ended[name] = Ended(code, (folder / name / "out.txt").read_text(errors="replace"), folder / name,
                                time.perf_counter() - started)
    finally:
        for process in processes.values():  # the jobs themselves: the cluster's teardown cancels them
            if process.poll() is None:
                process.kill()
                process.wait()
    return TwoNodeJobs(expected, **ended)


def ran_on_both_nodes(cluster: SlurmCluster, job_id: str) -> None:
    shown = cluster.run("scontrol", "show", "job", job_id).stdout
    assert "NodeList=node[1-2]" in shown and "NumNodes=2" in shown and "ExitCode=0:0" in shown, shown


def assert_one_rank_per_node(run_dir: Path, expected: list[float], said: str) -> None:
    """Rank 0 wrote the run files in ``run_dir`` and said what it was; each node's task was one rank (its log in
    the run directory); the losses are the own launcher's, step by step."""
    assert {"resolved.yaml", "ds_config.json", "metrics.json"} <= {p.name for p in run_dir.iterdir()}, said
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.stdout.log")) == ["rank0.stdout.log",
                                                                                   "rank1.stdout.log"]
    log = (run_dir / "dsrun.log").read_text()
    assert "training as rank 0 of srun: SLURM_STEP_NUM_TASKS=2 (1 per node on 2 node(s))" in log, log[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["train_losses"] == expected, said


@pytest.mark.timeout(2 * TIMEOUT)
def test_the_exported_sbatch_script_trains_one_rank_per_node_with_the_own_launchers_losses(two_node_cluster,
                                                                                           two_node_jobs):
    job = two_node_jobs.sbatch
    sys.stdout.write(f"the two-node sbatch job: {job.seconds:.1f} s\n")
    job_id = job.out.split()[0] if job.out.strip() else "?"
    logs = list(job.folder.glob(f"two-nodes-{job_id}.out"))  # the script's --output=%x-%j.out
    said = job.out + "".join(p.read_text(errors="replace")[-4000:] for p in logs)
    assert job.code == 0, said
    script = (job.folder.parent / "job.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script, script
    ran_on_both_nodes(two_node_cluster, job_id)
    (run_dir,) = (job.folder.parent / "runs").glob("outputs/*/*")  # one run directory, rank 0's
    assert_one_rank_per_node(run_dir, two_node_jobs.expected, said)


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_submitit_slurm_job_of_two_nodes_trains_one_rank_per_node_with_the_own_launchers_losses(
        two_node_cluster, two_node_jobs):
    sweep = two_node_jobs.sweep
    sys.stdout.write(f"the two-node submitit_slurm sweep: {sweep.seconds:.1f} s\n")
    logs = sorted(sweep.folder.rglob("*_log.*"))
    said = sweep.out[-3000:] + "".join(f"\n--- {p}\n{p.read_text(errors='replace')[-2500:]}" for p in logs)
    assert sweep.code == 0, said
    assert "sweep of 1 job(s): 1 finished, 0 failed" in sweep.out, said
    (run_dir,) = sweep.folder.glob("multirun/*/*/0")
    (script,) = run_dir.parent.glob(".submitit/*/*_submission.sh")
    assert "#SBATCH --nodes=2" in script.read_text() and "#SBATCH --ntasks-per-node=1" in script.read_text()
    ran_on_both_nodes(two_node_cluster, script.parent.name.split("_")[0])
    assert_one_rank_per_node(run_dir, two_node_jobs.expected, said)
